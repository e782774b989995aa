"""`reshard save SRC s3://bucket/prefix/` against a real S3 server (SeaweedFS, tests/fixtures/s3server.py).

What a reader of the prefix finds is checked byte for byte (tests/fixtures/s3run.py `prefix_state`:
every object its manifest lists, of its size and digest; nothing else under the prefix; no multipart
upload left open): the objects equal a local save of the same source, the store's own checksum of
each object is the one reshard computed, and every refusal, store failure and interrupt ends in
one line, a documented exit code, and the previous output (or nothing) still there, whole.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.cli import run
from tests.fixtures.s3out import one_line, url
from tests.fixtures.s3run import objects, open_uploads, paused, prefix_state, reshard, s3_env, synthetic_llama

pytest.importorskip("boto3")

MiB = 1 << 20


def split(raw: bytes) -> tuple[dict, bytes]:
    """A safetensors file as (header without the run id, data bytes)."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert len(header["__metadata__"].pop("reshard_run")) == 32
    return header, raw[8 + n :]


def assert_same_as_local(s3, bucket: str, prefix: str, local) -> None:
    """The prefix holds a verifying output equal to the local folder's but for the run id."""
    state = prefix_state(s3, bucket, prefix)
    assert state.verifies and state.uploads == [] and state.work == [], state
    objs = objects(s3, bucket, prefix)
    files = sorted(p.name for p in local.iterdir())
    assert sorted(objs) == files
    ours, theirs = state.manifest, json.loads((local / "reshard.json").read_text())
    for name in files:
        if name.endswith(".safetensors"):
            (h1, d1), (h2, d2) = split(objs[name]), split((local / name).read_bytes())
            assert h1 == h2 and d1 == d2, name
        elif name != "reshard.json":
            assert objs[name] == (local / name).read_bytes(), name
    plain = {"run_id", "created", "serve", "serve_reshard", "files", "store_sha256"}
    # the store's own checksum of every object, recorded as the store reports it
    stored = {name: s3.head_object(Bucket=bucket, Key=prefix + name, ChecksumMode="ENABLED")["ChecksumSHA256"]
              for name in files if name != "reshard.json"}  # fmt: skip
    assert ours["store_sha256"] == stored
    assert {k: v for k, v in ours.items() if k not in plain} == {k: v for k, v in theirs.items() if k not in plain}
    digest = ours["checksum"]
    strip = [[{k: v for k, v in f.items() if k != digest} for f in m["files"]] for m in (ours, theirs)]
    assert strip[0] == strip[1]
    assert f"vllm serve {url(bucket, prefix)} --load-format runai_streamer_sharded " in ours["serve"]


# ---- the objects equal a local save --------------------------------------------------------------

CASES = [
    ("llama", ("--tp", "2")),
    ("qwen3", ("--tp", "2")),
    ("qwen3-moe", ("--tp", "2")),
    ("qwen3-moe", ("--tp", "2", "--ep")),
    ("qwen3-moe-fp8", ("--tp", "2")),
    ("llama", ("--tp", "2", "--pp", "2")),
]


@pytest.mark.parametrize(("arch", "layout"), CASES, ids=[f"{a}{''.join(x.strip('-') for x in o)}" for a, o in CASES])
def test_objects_equal_a_local_save(tiny, tmp_path, s3, arch, layout):
    client, bucket = s3
    src = tiny(arch)
    assert run("save", str(src), str(tmp_path / "local"), *layout)[0] == 0
    code, _, err = run("save", str(src), url(bucket, "m/out/"), *layout)
    assert code == 0, err
    assert_same_as_local(client, bucket, "m/out/", tmp_path / "local")
    assert open_uploads(client, bucket) == []


@pytest.fixture(scope="session")
def mid(tmp_path_factory):
    """A 21 MB Llama-shaped checkpoint (2 layers, hidden 512): a TP 1 rank file of several 5 MiB parts."""
    sizes = dict(num_hidden_layers=2, hidden_size=512, intermediate_size=1536, num_attention_heads=8)
    sizes.update(num_key_value_heads=4, head_dim=64, vocab_size=4096)
    return synthetic_llama(tmp_path_factory.mktemp("mid") / "src", **sizes)


def composite(data: bytes, part: int) -> str:
    """S3's composite SHA256 of an object uploaded in `part`-byte parts: sha256 of the parts' sha256s."""
    digests = [hashlib.sha256(data[i : i + part]).digest() for i in range(0, len(data), part)]
    return base64.b64encode(hashlib.sha256(b"".join(digests)).digest()).decode() + f"-{len(digests)}"


def test_multipart_parts_and_the_stores_checksum(mid, tmp_path, s3, monkeypatch):
    client, bucket = s3
    monkeypatch.setenv("RESHARD_S3_PART_SIZE", str(5 * MiB))
    assert run("save", str(mid), str(tmp_path / "local"), "--tp", "1")[0] == 0
    code, _, err = run("save", str(mid), url(bucket, "big/"), "--tp", "1")
    assert code == 0, err
    assert_same_as_local(client, bucket, "big/", tmp_path / "local")
    key = "big/model-rank-0-part-0.safetensors"
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(data) > 4 * 5 * MiB
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == composite(data, 5 * MiB)
    assert head["ChecksumSHA256"].endswith("-5")
    assert open_uploads(client, bucket) == []


@pytest.mark.parametrize("size", [5 * MiB, 10 * MiB + 1, 3])
def test_object_writer_cuts_parts_at_the_part_size(s3, monkeypatch, size):
    """Writes of odd lengths across part boundaries: the object is the bytes, in ceil(size / part) parts."""
    from reshard.store.bucket import Bucket
    from reshard.store.upload import ObjectWriter, Uploads
    from reshard.store.url import parse_bucket_url

    client, bucket = s3
    monkeypatch.setenv("RESHARD_S3_PART_SIZE", str(5 * MiB))
    data = os.urandom(size)
    uploads = Uploads(Bucket(parse_bucket_url(url(bucket, "w/"))))
    try:
        w = ObjectWriter(uploads, "f.bin", data[:7], "blake3", size)
        pos = 7
        for n in (1, MiB - 3, 5 * MiB, 2 * MiB + 5, 10 * MiB):
            w.write(memoryview(data[pos : pos + n]))
            pos += n
        written = w.close(sync=False)
        assert written.size == size
        uploads.complete(uploads.open["w/f.bin"], create_only=True)
    finally:
        uploads.close()
    assert client.get_object(Bucket=bucket, Key="w/f.bin")["Body"].read() == data
    parts = -(-size // (5 * MiB))
    head = client.head_object(Bucket=bucket, Key="w/f.bin", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == composite(data, 5 * MiB) and head["ChecksumSHA256"].endswith(f"-{parts}")
    assert open_uploads(client, bucket) == []


def test_uploads_started_in_the_pool_are_all_aborted(s3):
    """`begin` starts uploads in the pool; aborting at once (a save failing as it opens its files)
    waits for the starts under way and cancels the rest: no upload is left open."""
    from reshard.store.bucket import Bucket
    from reshard.store.upload import Uploads
    from reshard.store.url import parse_bucket_url

    client, bucket = s3
    uploads = Uploads(Bucket(parse_bucket_url(url(bucket, "w/"))))
    try:
        ups = [uploads.begin(f"w/f{i}.bin") for i in range(40)]
        uploads.abort_all()
    finally:
        uploads.close()
    assert all(up.created is not None and up.created.done() for up in ups)
    assert open_uploads(client, bucket) == []


def test_small_objects_go_up_together_and_a_refused_completion_is_raised_once_the_rest_are_done(s3):
    """`put_objects` uploads several small objects at once; `complete_all` completes them together,
    and one refused (its key was taken meanwhile: If-None-Match) is raised after the others are in."""
    from reshard.errors import ReshardError
    from reshard.store.bucket import Bucket
    from reshard.store.upload import Uploads
    from reshard.store.url import parse_bucket_url

    client, bucket = s3
    items = [(f"w/s{i}.json", os.urandom(100 + i)) for i in range(12)]
    uploads = Uploads(Bucket(parse_bucket_url(url(bucket, "w/"))))
    try:
        ups = uploads.put_objects(items)
        assert [(up.key, up.size, len(up.parts)) for up in ups] == [(k, len(d), 1) for k, d in items]
        assert objects(client, bucket, "w/") == {}  # open uploads, not objects yet
        client.put_object(Bucket=bucket, Key="w/s5.json", Body=b"another run's")
        with pytest.raises(ReshardError, match=r"s5\.json"):
            uploads.complete_all(ups, create_only=lambda up: True)
        got = objects(client, bucket, "w/")  # before the pool is shut down: nothing was still running
    finally:
        uploads.close()
    assert got.pop("s5.json") == b"another run's"
    assert got == {k[len("w/") :]: d for k, d in items if k != "w/s5.json"}
    assert open_uploads(client, bucket) == ["w/s5.json"]  # the refused one, left to abort


# ---- guards --------------------------------------------------------------------------------------


@pytest.fixture
def saved(tiny, s3):
    """(source, client, bucket): a TP 2 output of the tiny llama at s3://bucket/out/."""
    client, bucket = s3
    src = tiny("llama")
    assert run("save", str(src), url(bucket, "out/"), "--tp", "2")[0] == 0
    return src, client, bucket


def test_not_empty_without_overwrite_is_refused(saved):
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4")
    assert code == 5 and "is not empty" in one_line(err) and "--overwrite" in err
    assert objects(client, bucket, "out/") == before
    assert prefix_state(client, bucket, "out/").verifies and open_uploads(client, bucket) == []


def test_overwrite_replaces_the_output_and_its_old_rank_files(tiny, s3, tmp_path):
    client, bucket = s3
    src = tiny("llama")
    assert run("save", str(src), url(bucket, "out/"), "--tp", "4")[0] == 0
    old = prefix_state(client, bucket, "out/")
    assert "model-rank-3-part-0.safetensors" in old.names
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "2", "--overwrite")
    assert code == 0, err
    assert run("save", str(src), str(tmp_path / "local"), "--tp", "2")[0] == 0
    assert_same_as_local(client, bucket, "out/", tmp_path / "local")  # no model-rank-2/3 left
    assert prefix_state(client, bucket, "out/").run != old.run


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_foreign_rank_file_below_the_prefix_is_refused(tiny, s3, overwrite):
    """vLLM lists without a delimiter: `out/old/model-rank-0-part-0.safetensors` would be loaded too."""
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="out/old/model-rank-0-part-0.safetensors", Body=b"x")
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2", *(["--overwrite"] * overwrite))
    assert code == 3 and "out/old/model-rank-0-part-0.safetensors" in one_line(err), err
    assert sorted(objects(client, bucket, "out/")) == ["old/model-rank-0-part-0.safetensors"]
    assert open_uploads(client, bucket) == []


def test_nested_outputs_are_refused_both_ways(saved):
    src, client, bucket = saved
    code, _, err = run("save", str(src), url(bucket, "out/tp4/"), "--tp", "4")
    assert code == 3 and "holds a reshard output" in one_line(err), err
    assert objects(client, bucket, "out/tp4/") == {}
    assert run("save", str(src), url(bucket, "all/tp2/"), "--tp", "2")[0] == 0
    code, _, err = run("save", str(src), url(bucket, "all/"), "--tp", "2")
    assert code == 3 and "all/tp2/model-rank-0-part-0.safetensors" in one_line(err), err
    assert prefix_state(client, bucket, "out/").verifies and prefix_state(client, bucket, "all/tp2/").verifies
    assert open_uploads(client, bucket) == []


def test_more_than_1000_keys_is_refused_with_a_max_part_size_that_fits(tiny, s3):
    """900 other objects under the prefix, and one file per tensor: over the 1000 keys vLLM's one
    listing call sees. The hint names a --max-part-size, and the run with it fits."""
    from concurrent.futures import ThreadPoolExecutor

    client, bucket = s3
    src = tiny("qwen3-moe")
    foreign = [f"many/notes/n-{i:04d}.txt" for i in range(900)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=b"n"), foreign))
    code, _, err = run("save", str(src), url(bucket, "many/"), "--tp", "2", "--max-part-size", "1", "--overwrite")
    # 900 + 108 rank files (one per tensor) + 4 side files + the manifest
    assert code == 3 and "would hold 1013 objects" in one_line(err) and "first 1000 keys" in err, err
    sides = 4  # config.json, generation_config.json, tokenizer.json, tokenizer_config.json
    assert f"pass --max-part-size 1GiB (at most {(1000 - 900 - sides - 1) // 2} files per rank)" in err
    assert len(objects(client, bucket, "many/")) == 900 and open_uploads(client, bucket) == []
    code, _, err = run("save", str(src), url(bucket, "many/"), "--tp", "2", "--max-part-size", "1GiB", "--overwrite")
    assert code == 0, err
    state = prefix_state(client, bucket, "many/")
    assert state.verifies and len(state.strays) == 900


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("gs://b/out/", "gs:// object storage is not supported"),
        ("s3://bucket-root/", "a bucket's root"),
        # vLLM's pattern for rank 0, *model-rank-0-part-*.safetensors, would match rank 1's keys under it
        ("s3://bucket1/m/model-rank-0-part-0.safetensors/", "the prefix holds a rank file's name"),
        ("s3://bucket1/model-pp-1-tp-0-part-0/", "the prefix holds a rank file's name"),
        ("s3://bucket1/a\\b/", "the prefix holds a backslash"),  # SeaweedFS: keys a/b/..., listed under a\\b/: none
        ("s3://bucket1/" + "x" * 1000 + "/", "a key would pass S3's 1024 bytes"),
    ],
)
def test_other_schemes_and_a_bucket_root_are_refused(tiny, s3, where, says):
    code, _, err = run("save", str(tiny("llama")), where, "--tp", "2")
    assert code == 3 and says in one_line(err), err


def _lock(client, bucket: str, **held) -> None:
    client.put_object(Bucket=bucket, Key="out.reshard/lock.json", Body=json.dumps(held).encode())


def test_a_lock_of_another_host_is_refused_naming_it(tiny, s3):
    client, bucket = s3
    _lock(client, bucket, host="builder-7", pid=4242, run="x", since=int(time.time()))
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2")
    assert code == 5 and "host builder-7, pid 4242" in one_line(err), err
    assert "out.reshard/lock.json" in err
    assert objects(client, bucket, "out/") == {} and open_uploads(client, bucket) == []


def test_something_else_at_the_lock_path_is_named_as_such(tiny, s3):
    """The exit-code table's "something other than reshard's lock at the lock path": told as that,
    not as another run (host ?, pid 0)."""
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="out.reshard/lock.json", Body=b"garbage{")
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2")
    line = one_line(err)
    assert code == 5 and "is not a reshard lock" in line and "delete it if no reshard run" in line, err
    assert "pid 0" not in line


def test_a_dead_lock_of_this_host_is_taken_over(tiny, s3):
    client, bucket = s3
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _lock(client, bucket, host=socket.gethostname(), pid=gone.pid, run="x", since=int(time.time()))
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2")
    assert code == 0, err
    state = prefix_state(client, bucket, "out/")
    assert state.verifies and state.work == [] and state.uploads == []


# ---- the store failing -----------------------------------------------------------------------------


def assert_untouched(client, bucket: str, before: dict[str, bytes]) -> None:
    """The prefix holds what it held (a verifying output, or nothing); no upload open, no lock left."""
    assert objects(client, bucket, "out/") == before
    state = prefix_state(client, bucket, "out/")
    assert state.uploads == [] and state.work == [] and (state.verifies or not before), state
    assert open_uploads(client, bucket) == []


@pytest.mark.parametrize("endpoint", [True, False], ids=["endpoint", "aws"])
def test_no_credentials(tiny, s3, monkeypatch, endpoint):
    client, bucket = s3
    for k in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        *(() if endpoint else ("AWS_ENDPOINT_URL",)),
    ):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2")
    assert code == 5 and "no AWS credentials for" in one_line(err) and "AWS_ACCESS_KEY_ID" in err, err
    assert_untouched(client, bucket, {})


def test_wrong_endpoint(tiny, s3, monkeypatch):
    client, bucket = s3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("RESHARD_S3_RETRIES", "1")
    code, _, err = run("save", str(tiny("llama")), url(bucket, "out/"), "--tp", "2")
    assert code == 5 and f"cannot reach the object store at http://127.0.0.1:{closed}" in one_line(err), err
    assert_untouched(client, bucket, {})


def test_missing_bucket(tiny, s3):
    code, _, err = run("save", str(tiny("llama")), "s3://no-such-bucket-here/out/", "--tp", "2")
    assert code == 5 and "bucket no-such-bucket-here does not exist" in one_line(err), err


def test_read_only_identity(saved, monkeypatch, s3server):
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    for k, v in s3server.env(readonly=True).items():
        monkeypatch.setenv(k, v)
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    assert code == 5 and "access to" in one_line(err) and "denied" in err, err
    assert_untouched(client, bucket, before)


def _through(proxy, monkeypatch, s3server, **faults) -> None:
    for k, v in s3server.env(endpoint=proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    for k, v in faults.items():
        setattr(proxy, k, v)


def _parts(method: str, path: str, query: str) -> bool:
    return method == "PUT" and "partNumber=" in query


def test_forbidden_mid_upload(saved, s3proxy, monkeypatch, s3server):
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    _through(s3proxy, monkeypatch, s3server, forbidden=1, only=_parts)
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    assert code == 5 and "denied (uploading part 1 of model-rank-" in one_line(err), err
    assert_untouched(client, bucket, before)


def test_forbidden_start_of_a_rank_files_upload(saved, s3proxy, monkeypatch, s3server):
    """A rank file's upload is started in the pool (reshard.store.upload.Uploads.begin): its
    refusal is the save's one-line error, and nothing is published."""
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    starts = lambda method, path, query: method == "POST" and query.startswith("uploads") and "model-rank-" in path  # noqa: E731
    _through(s3proxy, monkeypatch, s3server, forbidden=1, only=starts)
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    assert code == 5 and "denied (starting the upload of out/model-rank-" in one_line(err), err
    assert_untouched(client, bucket, before)
    assert open_uploads(client, bucket) == []


def test_a_failure_during_the_commit_says_the_next_run_finishes_it(saved, s3proxy, monkeypatch, s3server):
    """Completions refused (403) once the commit began: the old manifest is withdrawn and the journal
    kept, and the one error line says so and what to do; the same command again finishes publishing
    that output first, then stops saying whose it is (not a bare "not empty")."""
    src, client, bucket = saved
    completes = lambda method, path, query: method == "POST" and query.startswith("uploadId=")  # noqa: E731
    _through(s3proxy, monkeypatch, s3server, forbidden=1, only=completes)
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    line = one_line(err)
    assert code == 5 and "denied (completing" in line and "publishing stopped half-way" in line, err
    assert "rerun `reshard save` to s3://" in line and "finishes publishing this run's output" in line
    left = prefix_state(client, bucket, "out/")
    assert left.manifest is None and "commit.json" in left.work  # never a manifest without its files
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4")
    assert code == 5 and "finished publishing the output of interrupted run" in err, err
    assert "whose publishing this run has just finished" in err.strip().splitlines()[-1]
    state = prefix_state(client, bucket, "out/")
    assert state.verifies and state.manifest["layout"]["tp"] == 4 and state.uploads == [] and state.work == []


def _listing(rewrite):
    """A rewrite of ListObjectsV2 answers only (GET on the bucket with list-type=2)."""
    return lambda method, path, query, body: rewrite(body) if "list-type=2" in query else body


@pytest.mark.parametrize(
    "lie, says",
    [
        (lambda body: re.sub(rb"<Contents>.*?</Contents>", b"", body, flags=re.S), "does not show it"),
        (lambda body: b"<html>proxy error</html>", "is not an S3 listing"),
    ],
    ids=["keys-hidden", "html"],
)
def test_a_listing_that_lies_does_not_withdraw_the_output(saved, s3proxy, monkeypatch, s3server, lie, says):
    """A listing that hides the prefix's objects (a lagging or lying store, a proxy's HTML page read as an
    empty listing): the save without --overwrite went ahead, deleted the previous manifest, then failed
    on its first create-only completion; the output was gone. Now exit 5 before anything is written."""
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    _through(s3proxy, monkeypatch, s3server)
    s3proxy.rewrite = _listing(lie)
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4")
    assert code == 5 and says in one_line(err), err
    s3proxy.rewrite = None
    assert_untouched(client, bucket, before)


def test_a_store_that_confirms_no_part_checksum_is_refused(saved, s3proxy, monkeypatch, s3server):
    """Part bodies are not signed (the checksum header is): a store that does not say it checked the
    checksum could have kept other bytes, so nothing is published."""
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    _through(s3proxy, monkeypatch, s3server)
    s3proxy.hide_checksums = True
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    assert code == 5 and "did not confirm the SHA256" in one_line(err), err
    s3proxy.hide_checksums = False
    assert_untouched(client, bucket, before)


def test_throttling_is_retried(tiny, s3, s3proxy, monkeypatch, s3server, tmp_path):
    client, bucket = s3
    _through(s3proxy, monkeypatch, s3server, slowdown=2)
    src = tiny("llama")
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "2")
    assert code == 0, err
    assert [e[3] for e in s3proxy.log[:3]] == [503, 503, 200]
    assert run("save", str(src), str(tmp_path / "local"), "--tp", "2")[0] == 0
    assert_same_as_local(client, bucket, "out/", tmp_path / "local")


def test_throttling_beyond_the_retries(saved, s3proxy, monkeypatch, s3server):
    src, client, bucket = saved
    before = objects(client, bucket, "out/")
    _through(s3proxy, monkeypatch, s3server, slowdown=100, only=_parts)
    monkeypatch.setenv("RESHARD_S3_RETRIES", "1")
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite")
    assert code == 5 and "kept throttling" in one_line(err) and "after 1 retries" in err, err
    s3proxy.slowdown = 0
    assert_untouched(client, bucket, before)


def test_a_part_dropped_mid_body_is_sent_again(tiny, s3, s3proxy, monkeypatch, s3server, tmp_path):
    client, bucket = s3
    _through(s3proxy, monkeypatch, s3server, drop_mid_body=1)
    src = tiny("llama")
    code, _, err = run("save", str(src), url(bucket, "out/"), "--tp", "2")
    assert code == 0, err
    assert [e[3] for e in s3proxy.log if _parts(*e[:3])].count(0) == 1
    assert run("save", str(src), str(tmp_path / "local"), "--tp", "2")[0] == 0
    assert_same_as_local(client, bucket, "out/", tmp_path / "local")


# ---- interrupts ------------------------------------------------------------------------------------


def _stopped(saved, s3server, tmp_path, at: str) -> tuple[subprocess.Popen, dict, Path]:
    """`save --tp 4 --overwrite` over the TP 2 output, stopped at moment `at` (tests/fixtures/s3run.py)."""
    src, _, bucket = saved
    marker = tmp_path / "stopped"
    env = s3_env(s3server)
    p = paused(["save", str(src), url(bucket, "out/"), "--tp", "4", "--overwrite"], env, at=at, marker=marker)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    return p, env, marker


@pytest.mark.parametrize("at", ["upload", "commit"])
def test_ctrl_c_before_the_commit_keeps_the_previous_output(saved, s3server, tmp_path, at):
    _, client, bucket = saved
    before = objects(client, bucket, "out/")
    p, _, marker = _stopped(saved, s3server, tmp_path, at)
    assert open_uploads(client, bucket, "out/")  # the new output's uploads, open, invisible
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)
    marker.unlink()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "nothing was published" in one_line(err), err
    assert_untouched(client, bucket, before)


def test_ctrl_c_during_the_commit_finishes_it(saved, s3server, tmp_path):
    """Signals are held while committing: the new output is published whole, then the run says so."""
    _, client, bucket = saved
    p, _, marker = _stopped(saved, s3server, tmp_path, "completing")
    assert prefix_state(client, bucket, "out/").manifest is None  # the old one is gone, the new not yet in
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)  # held: the run goes on when the pause ends
    marker.unlink()
    _, err = p.communicate(timeout=60)
    state = prefix_state(client, bucket, "out/")
    assert state.verifies and state.manifest["layout"]["tp"] == 4, (state, err)
    assert state.uploads == [] and state.work == []
    assert p.returncode in (0, 130), err
    if p.returncode == 130:
        assert "interrupted after publishing" in one_line(err), err


def test_a_run_killed_during_the_commit_is_finished_by_the_next(saved, s3server, tmp_path):
    src, client, bucket = saved
    p, env, _ = _stopped(saved, s3server, tmp_path, "completing")
    p.kill()
    p.communicate(timeout=60)
    left = prefix_state(client, bucket, "out/")
    assert left.manifest is None and left.uploads  # never a manifest without its files
    assert sorted(left.work) == ["commit.json", "lock.json"]
    r = reshard(["save", str(src), url(bucket, "out/"), "--tp", "2"], env)
    told, refused = r.stderr.strip().splitlines()  # what it finished, then why it stopped
    assert "finished publishing the output of interrupted run" in told, r.stderr
    assert r.returncode == 5 and "whose publishing this run has just finished" in one_line(refused), r.stderr
    assert "`reshard verify` it; pass --overwrite to replace it" in refused
    state = prefix_state(client, bucket, "out/")
    assert state.verifies and state.manifest["layout"]["tp"] == 4 and "model-rank-3-part-0.safetensors" in state.names
    assert state.uploads == [] and state.work == [] and open_uploads(client, bucket) == []
