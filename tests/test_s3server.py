"""The S3 test server (SeaweedFS) behaves as reshard's object-storage tests assume, and its fault proxy works."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.fixtures.s3server import S3Server

botocore_exceptions = pytest.importorskip("botocore.exceptions")
ClientError = botocore_exceptions.ClientError


def _code(exc: pytest.ExceptionInfo) -> tuple[str, int]:
    err = exc.value.response
    return err["Error"]["Code"], err["ResponseMetadata"]["HTTPStatusCode"]


def test_weed_listens_only_on_the_ports_given_to_it(s3server):
    given = {flag: port for flag, port in s3server.ports.items() if flag != "debug.port"}  # -debug is off
    listening = s3server.listening_ports()
    assert listening <= set(given.values()), (
        f"weed listens on ports it was not given: {listening - set(given.values())}"
    )
    assert s3server.ports["s3.port"] in listening
    assert s3server.ports["admin.port.grpc"] == s3server.ports["admin.port"] + 10000


def test_put_get_list_round_trip(s3server, s3bucket):
    s3 = s3server.client()
    data = os.urandom(300_000)
    s3.put_object(Bucket=s3bucket, Key="p/model-rank-0-part-0.safetensors", Body=data)
    s3.put_object(Bucket=s3bucket, Key="p/reshard.json", Body=b"{}")
    assert s3.get_object(Bucket=s3bucket, Key="p/model-rank-0-part-0.safetensors")["Body"].read() == data
    listed = s3.list_objects_v2(Bucket=s3bucket, Prefix="p/")["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [
        ("p/model-rank-0-part-0.safetensors", 300_000),
        ("p/reshard.json", 2),
    ]
    got = s3.get_object(Bucket=s3bucket, Key="p/model-rank-0-part-0.safetensors", Range="bytes=10-19")
    assert got["Body"].read() == data[10:20]


def _sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def test_part_with_a_wrong_sha256_is_refused_with_bad_digest(s3server, s3bucket):
    s3 = s3server.client()
    up = s3.create_multipart_upload(Bucket=s3bucket, Key="k", ChecksumAlgorithm="SHA256")["UploadId"]
    part = os.urandom(100_000)
    with pytest.raises(ClientError) as exc:
        s3.upload_part(
            Bucket=s3bucket, Key="k", UploadId=up, PartNumber=1, Body=part, ChecksumSHA256=_sha256_b64(part + b"x")
        )
    assert _code(exc) == ("BadDigest", 400)
    ok = s3.upload_part(
        Bucket=s3bucket, Key="k", UploadId=up, PartNumber=1, Body=part, ChecksumSHA256=_sha256_b64(part)
    )
    assert ok["ChecksumSHA256"] == _sha256_b64(part)
    s3.complete_multipart_upload(
        Bucket=s3bucket,
        Key="k",
        UploadId=up,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": ok["ETag"], "ChecksumSHA256": ok["ChecksumSHA256"]}]},
    )
    assert s3.get_object(Bucket=s3bucket, Key="k")["Body"].read() == part


def test_if_none_match_creates_once(s3server, s3bucket):
    s3 = s3server.client()
    s3.put_object(Bucket=s3bucket, Key="reshard.json", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=s3bucket, Key="reshard.json", Body=b"second", IfNoneMatch="*")
    assert _code(exc) == ("PreconditionFailed", 412)
    assert s3.get_object(Bucket=s3bucket, Key="reshard.json")["Body"].read() == b"first"


def test_read_only_identity_reads_but_cannot_write(s3server, s3bucket):
    s3server.client().put_object(Bucket=s3bucket, Key="a", Body=b"abc")
    reader = s3server.client(readonly=True)
    assert reader.get_object(Bucket=s3bucket, Key="a")["Body"].read() == b"abc"
    assert [o["Key"] for o in reader.list_objects_v2(Bucket=s3bucket)["Contents"]] == ["a"]
    with pytest.raises(ClientError) as exc:
        reader.put_object(Bucket=s3bucket, Key="b", Body=b"x")
    assert _code(exc) == ("AccessDenied", 403)


def test_missing_bucket_and_wrong_keys(s3server):
    with pytest.raises(ClientError) as exc:
        s3server.client().list_objects_v2(Bucket="no-such-bucket-here")
    assert _code(exc) == ("NoSuchBucket", 404)
    bad = s3server.client()
    bad._request_signer._credentials.access_key = "nobody"
    with pytest.raises(ClientError) as exc:
        bad.list_buckets()
    assert _code(exc) == ("InvalidAccessKeyId", 403)


def test_env_points_a_bare_boto3_client_at_the_server_path_style(s3server, s3bucket, s3proxy):
    """A subprocess given only env() (through the proxy, to see the requests) reads with path addressing."""
    s3server.client().put_object(Bucket=s3bucket, Key="x/y", Body=b"via env")
    code = "import boto3, sys; print(boto3.client('s3').get_object(Bucket=sys.argv[1], Key='x/y')['Body'].read())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3server.env(endpoint=s3proxy.endpoint))
    out = subprocess.run([sys.executable, "-c", code, s3bucket], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "b'via env'\n"
    assert s3proxy.log == [("GET", f"/{s3bucket}/x/y", "", 200)]


def test_proxy_keeps_signatures_valid(s3server, s3bucket, s3proxy):
    s3 = s3server.client(endpoint=s3proxy.endpoint)
    s3.put_object(Bucket=s3bucket, Key="k", Body=b"through the proxy")
    assert s3.get_object(Bucket=s3bucket, Key="k")["Body"].read() == b"through the proxy"
    assert s3.head_object(Bucket=s3bucket, Key="k")["ContentLength"] == 17
    assert [e[0::3] for e in s3proxy.log] == [("PUT", 200), ("GET", 200), ("HEAD", 200)]


def test_slowdown_is_retried_by_standard_mode(s3server, s3bucket, s3proxy):
    s3 = s3server.client(endpoint=s3proxy.endpoint, retries={"mode": "standard", "total_max_attempts": 3})
    s3proxy.slowdown = 2
    resp = s3.put_object(Bucket=s3bucket, Key="k", Body=b"data")
    assert resp["ResponseMetadata"]["RetryAttempts"] == 2
    assert s3proxy.log == [("PUT", f"/{s3bucket}/k", "", status) for status in (503, 503, 200)]
    assert s3proxy.slowdown == 0
    assert s3server.client().get_object(Bucket=s3bucket, Key="k")["Body"].read() == b"data"


def test_slowdown_beyond_the_attempts_fails(s3server, s3bucket, s3proxy):
    s3 = s3server.client(endpoint=s3proxy.endpoint, retries={"mode": "standard", "total_max_attempts": 2})
    s3proxy.slowdown = 5
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=s3bucket, Key="k", Body=b"data")
    assert _code(exc) == ("SlowDown", 503)
    assert [e[3] for e in s3proxy.log] == [503, 503]


def test_forbidden_is_not_retried(s3server, s3bucket, s3proxy):
    s3 = s3server.client(endpoint=s3proxy.endpoint)
    s3proxy.forbidden = 1
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=s3bucket, Key="k")
    assert _code(exc) == ("AccessDenied", 403)
    assert s3proxy.log == [("GET", f"/{s3bucket}/k", "", 403)]


def test_part_dropped_mid_body_is_retried(s3server, s3bucket, s3proxy):
    s3 = s3server.client(endpoint=s3proxy.endpoint)
    up = s3.create_multipart_upload(Bucket=s3bucket, Key="big")["UploadId"]
    part = os.urandom(2 << 20)
    s3proxy.drop_mid_body = 1
    s3proxy.only = lambda method, path, query: path.endswith("/big")
    resp = s3.upload_part(Bucket=s3bucket, Key="big", UploadId=up, PartNumber=1, Body=part)
    assert resp["ResponseMetadata"]["RetryAttempts"] == 1
    s3.complete_multipart_upload(
        Bucket=s3bucket, Key="big", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": resp["ETag"]}]}
    )
    statuses = [(e[0], e[3]) for e in s3proxy.log]
    assert statuses == [("POST", 200), ("PUT", 0), ("PUT", 200), ("POST", 200)]
    assert "partNumber=1" in s3proxy.log[1][2]
    assert s3server.client().get_object(Bucket=s3bucket, Key="big")["Body"].read() == part


def test_stop_leaves_no_weed_running(tmp_path):
    server = S3Server(tmp_path / "s3").start()
    pid, port = server.pid, server.ports["s3.port"]
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert json.loads((tmp_path / "s3" / "s3-identities.json").read_text())["identities"][1]["actions"] == [
        "Read",
        "List",
    ]


def _temp_entries() -> dict[str, tuple[int, str]]:
    """Everything in /tmp (where weed mini binds its gRPC sockets, whatever TMPDIR says) and in the temp dir
    (where glog writes unless told otherwise): path -> (inode, the target of a symlink)."""
    entries = {}
    for d in {"/tmp", tempfile.gettempdir()}:
        with os.scandir(d) as it:
            for e in it:
                target = os.readlink(e.path) if e.is_symlink() else ""
                entries[e.path] = (e.inode(), target)
    return entries


def test_start_kill_restart_stop_leave_nothing_in_the_temp_dirs(tmp_path):
    before = _temp_entries()
    server = S3Server(tmp_path / "s3").start()
    marks = {str(server.pid), *map(str, server.ports.values())}
    server.kill()  # a crash: weed unlinks nothing itself
    server.start(same_ports=True)
    marks.add(str(server.pid))
    server.stop()
    # other processes on the machine write there too: only weed's files naming this weed's pids or ports count
    left = sorted(
        f"{path} -> {target}" if target else path
        for path, (inode, target) in _temp_entries().items()
        if before.get(path) != (inode, target)
        and "weed" in f"{path} {target}"
        and marks & set(re.findall(r"\d+", f"{path} {target}"))
    )
    assert left == []
