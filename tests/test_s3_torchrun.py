"""torchrun into a bucket: every process streams its share of the rank files into uploads it leaves
open; process 0 finds them on the store and commits them all with the manifest (reshard/destination.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from reshard.names import DEFAULT_MAX_PART
from tests.fixtures.saving import save


def torchrun(args: list[str], env: dict) -> subprocess.CompletedProcess:
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    return subprocess.run([*cmd, "-m", "reshard", *args], env=env, capture_output=True, text=True, timeout=300)


def test_two_processes_write_the_bytes_one_process_writes(tiny, tmp_path, s3server, s3bucket):
    src = tiny("qwen3-moe")
    pieces = tmp_path / "pieces"  # the same job as single-process pieces: the same run id, the same bytes
    for spec in ("0-1", "2-3"):
        save(str(src), pieces, tp=4, max_part_size=DEFAULT_MAX_PART, ranks=spec)
    env = {**os.environ, **s3server.env(), "RESHARD_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    p = torchrun(["save", str(src), f"s3://{s3bucket}/moe/", "--tp", "4", "--json"], env)
    assert p.returncode == 0, p.stderr[-2000:]
    client = s3server.client()
    for r in range(4):
        name = f"model-rank-{r}-part-0.safetensors"
        body = client.get_object(Bucket=s3bucket, Key=f"moe/{name}")["Body"].read()
        assert body == (pieces / name).read_bytes()
    manifest = json.loads(client.get_object(Bucket=s3bucket, Key="moe/reshard.json")["Body"].read())
    assert len(manifest["files"]) == 4
    assert not client.list_multipart_uploads(Bucket=s3bucket).get("Uploads")
    assert not client.list_objects_v2(Bucket=s3bucket, Prefix="moe.reshard/").get("Contents")  # lock released


def test_a_process_failing_mid_upload_leaves_no_open_upload(tiny, s3server, s3proxy, s3bucket):
    """One part upload is refused (403, not retried): that process fails, every process stops, and
    process 0 aborts every upload under the prefix, the other process's too."""
    env = {**os.environ, **s3server.env(endpoint=s3proxy.endpoint), "RESHARD_DISABLE_PROGRESS": "1"}
    env["OMP_NUM_THREADS"] = "1"
    s3proxy.only = lambda method, path, query: method == "PUT" and "partNumber=1" in query and "rank-1" in path
    s3proxy.forbidden = 1
    p = torchrun(["save", str(tiny("qwen3-moe")), f"s3://{s3bucket}/x/", "--tp", "2"], env)
    assert p.returncode != 0 and "access to" in p.stderr and "denied" in p.stderr, p.stderr[-2000:]
    assert s3proxy.forbidden == 0  # the fault was hit
    client = s3server.client()
    assert not client.list_multipart_uploads(Bucket=s3bucket).get("Uploads")
    assert not client.list_objects_v2(Bucket=s3bucket, Prefix="x/").get("Contents")
    assert not client.list_objects_v2(Bucket=s3bucket, Prefix="x.reshard/").get("Contents")
