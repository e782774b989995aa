"""torchrun into a bucket: every process streams its share of the rank files into uploads it leaves
open; process 0 finds them on the store and commits them all with the manifest (reshard/destination.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from reshard.names import DEFAULT_MAX_PART
from tests.fixtures.saving import save
from tests.fixtures.torchrun import torchrun as run_torchrun


def torchrun(args: list[str], env: dict, module: str = "reshard") -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as logs:
        return run_torchrun(Path(logs), ["-m", module, *args], env)


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


def test_a_bucket_source_the_store_cannot_vouch_for_is_hashed_once_between_the_processes(
    tiny, tmp_path, s3env, s3proxy
):
    """Re-sharding a bucket output whose store reports no checksums, under torchrun, read by tensor (as a large
    model is: no rank file hashed as it streams): each process hashes its share of the rank files in a second
    read (one file each here, not both files twice), and the flipped one fails the job."""
    from tests.fixtures.s3out import bucket_output

    out = bucket_output(s3env, tiny("llama"), tp=2)
    out.flip_tensor("model-rank-1-part-0.safetensors")
    s3proxy.hide_checksums = True
    env = {**os.environ, **s3env.env(endpoint=s3proxy.endpoint), "RESHARD_DISABLE_PROGRESS": "1"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    p = torchrun(["save", out.url, str(tmp_path / "tp4"), "--tp", "4"], env, module="tests.fixtures.bytensor")
    assert p.returncode != 0 and "model-rank-1-part-0.safetensors fails its blake3 checksum" in p.stderr, p.stderr
    hashing = sorted(
        line.split(": hashing ")[1].split(" (")[0] for line in p.stderr.splitlines() if ": hashing " in line
    )
    assert hashing == ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"], p.stderr
    assert not (tmp_path / "tp4").exists()


def test_a_bucket_source_that_serves_other_bytes_once_fails_under_torchrun(tiny, tmp_path, s3env, s3proxy):
    """The same store serving a flipped byte to the first read of a tensor of one rank file, the written bytes
    afterwards: whichever process read it, the bytes it used are checked (the process hashing that file hashes
    the bytes it read; another compares the ranges it used with a read of them again): the job fails."""
    from tests.fixtures.s3out import bucket_output, lie_once

    out = bucket_output(s3env, tiny("llama"), tp=2)
    s3proxy.hide_checksums = True
    told = lie_once(s3proxy, out, "model-rank-1-part-0.safetensors")
    env = {**os.environ, **s3env.env(endpoint=s3proxy.endpoint), "RESHARD_DISABLE_PROGRESS": "1"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    p = torchrun(["save", out.url, str(tmp_path / "tp4"), "--tp", "4"], env, module="tests.fixtures.bytensor")
    assert len(told) == 1, p.stderr
    assert p.returncode != 0 and "model-rank-1-part-0.safetensors" in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("reshard: error:")]
    assert errors and all("model-rank-1-part-0.safetensors" in line for line in errors), p.stderr
    assert not (tmp_path / "tp4").exists()
