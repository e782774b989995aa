"""Hub repo ids against a local server that speaks the Hub's HTTP interface (tests/fixtures/hubserver.py).

Each run is a subprocess: huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when imported.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.fixtures.hubrun import REPO, one_line_error, rank_bytes, reshard, serving, tiny_with_reference
from tests.fixtures.hubserver import HubServer


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 3-shard tiny checkpoint and `save --tp 2` of it from the folder (the reference)."""
    return tiny_with_reference(tmp_path_factory.mktemp("hubsrc"), shards=3)


@pytest.fixture
def hub(source):
    with serving(source[0]) as server:
        yield server


def weight_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.glob("*.safetensors"))


def header_bytes(src: Path) -> int:
    """The bytes of the safetensors headers (length field and JSON) of `src`'s weight files."""
    return sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in src.glob("*.safetensors"))


def cdn_gets(hub: HubServer) -> list[str]:
    return [path for method, path, status in hub.log if method == "GET" and path.startswith("/cdn/") and status == 206]


def test_plan_fetches_config_and_headers_only(hub, source, tmp_path):
    p = reshard(hub, tmp_path / "hf", "plan", REPO, "--tp", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["source"] == {"repo_id": REPO, "revision": "main", "commit": hub.sha}
    assert hub.served == header_bytes(source[0])  # no weight byte
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_save_streamed_and_cached_match_a_local_save(hub, source, tmp_path):
    src, ref = source
    home = tmp_path / "hf"
    p = reshard(hub, home, "save", REPO, str(tmp_path / "streamed"), "--tp", "2", "--stream")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "streamed") == rank_bytes(ref)
    manifest = json.loads((tmp_path / "streamed" / "reshard.json").read_text())
    assert manifest["source"] == {"repo_id": REPO, "revision": "main", "commit": hub.sha}
    assert not list(home.rglob("*.safetensors")) and not list(home.rglob("*.reshard-*"))  # nothing stored
    assert hub.served == weight_bytes(src)  # headers, then every tensor once
    shards = len(list(src.glob("*.safetensors")))
    assert len(cdn_gets(hub)) <= 3 * shards  # length, header, then the small tensors side by side at once

    served, gets = hub.served, len(cdn_gets(hub))
    p = reshard(hub, home, "save", REPO, str(tmp_path / "cached"), "--tp", "2", RESHARD_HUB_SMALL="0")
    assert p.returncode == 0, p.stderr
    assert len(cdn_gets(hub)) - gets >= len(
        json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert rank_bytes(tmp_path / "cached") == rank_bytes(ref)
    assert hub.served - served == weight_bytes(src)  # every byte once: tensors, then headers and the rest
    snap = home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / hub.sha
    for f in src.glob("*.safetensors"):
        assert (snap / f.name).is_symlink() and (snap / f.name).read_bytes() == f.read_bytes()
    assert not list(home.rglob("*.reshard-*"))

    served = hub.served  # complete in the cache: read as a folder, nothing downloaded
    p = reshard(hub, home, "save", REPO, str(tmp_path / "again"), "--tp", "2")
    assert p.returncode == 0 and hub.served == served, p.stderr
    assert rank_bytes(tmp_path / "again") == rank_bytes(ref)

    hub.stop()  # and offline, from that cache
    p = reshard(hub, home, "save", REPO, str(tmp_path / "offline"), "--tp", "2", HF_HUB_OFFLINE="1")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "offline") == rank_bytes(ref)


def test_offline_without_a_cache_fails_with_exit_4(hub, tmp_path):
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, "not in the Hugging Face cache")


def test_interrupted_download_resumes(hub, source, tmp_path):
    src, ref = source
    home = tmp_path / "hf"
    total = weight_bytes(src)
    hub.budget = header_bytes(src) + total // 2  # the connection dies for good half-way
    p = reshard(hub, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, "failed", "run again")
    assert not (tmp_path / "out").exists()
    assert list(home.rglob("*.reshard-partial"))
    first = hub.served
    hub.budget = None
    p = reshard(hub, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    again = hub.served - first
    assert again < total * 0.6, (again, total)  # what the first run received was not fetched again
    assert not list(home.rglob("*.reshard-*"))


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_dropped_connections_and_garbage_are_retried(hub, source, tmp_path, mode):
    hub.drop_after, hub.drops, hub.garbage, hub.errors, hub.api_garbage = 3000, 4, 3, 2, 1
    args = ["--stream"] if mode == "--stream" else []
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", *args)
    assert p.returncode == 0, p.stderr
    assert hub.drops == hub.garbage == hub.errors == hub.api_garbage == 0  # every fault was met
    assert rank_bytes(tmp_path / "out") == rank_bytes(source[1])


def test_garbage_for_good_is_exit_4(hub, tmp_path):
    hub.garbage = 10**6
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    one_line_error(p, 4, "failed 4 times in a row")
    hub.garbage = 0
    hub.drop_after, hub.drops = 0, 10**6
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    one_line_error(p, 4, "failed 4 times in a row")
    hub.api_garbage = 10**6
    p = reshard(hub, tmp_path / "hf", "plan", REPO, "--tp", "2")
    one_line_error(p, 4, "model info", "failed 4 times in a row")


def test_gated_repo_wants_a_token(hub, tmp_path):
    hub.tokens[REPO] = "hf_right"
    args = ["plan", REPO, "--tp", "2"]
    one_line_error(reshard(hub, tmp_path / "hf", *args), 4, "access denied", "HF_TOKEN")
    one_line_error(reshard(hub, tmp_path / "hf", *args, HF_TOKEN="hf_wrong"), 4, "access denied")
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", HF_TOKEN="hf_right")
    assert p.returncode == 0, p.stderr
    assert hub.served > 0 and hub.cdn_auth == 0  # the token went to the Hub, not to the CDN


def test_missing_repo_revision_and_file_are_exit_4(hub, tmp_path):
    one_line_error(reshard(hub, tmp_path / "hf", "plan", "acme/absent", "--tp", "2"), 4, "not found")
    p = reshard(hub, tmp_path / "hf", "plan", REPO, "--tp", "2", "--revision", "nope")
    one_line_error(p, 4, "revision not found")
    hub.missing.add("model-00002-of-00003.safetensors")
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, "model-00002-of-00003.safetensors", "not found")


def test_revision_is_pinned_while_the_branch_moves(hub, source, tmp_path):
    from tests.fixtures.tiny import make_tiny

    other = make_tiny("qwen3", tmp_path / "other", shards=3, seed=7)
    first = hub.sha
    moved: list[str] = []

    def move(server, repo_id):  # the first model-info answer is the last one that says `first`
        if not moved:
            moved.append(server.add_repo(REPO, other))

    hub.on_api = move
    p = reshard(hub, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", RESHARD_DISABLE_PROGRESS="0")
    assert p.returncode == 0, p.stderr
    assert "writing: " in p.stderr and "downloaded: " in p.stderr  # one display, both counts and rates
    assert moved and hub.repos[REPO].refs["main"] != first
    assert json.loads((tmp_path / "out" / "reshard.json").read_text())["source"]["commit"] == first
    assert rank_bytes(tmp_path / "out") == rank_bytes(source[1])


def test_cached_blob_tracks_the_ranges_it_holds(tmp_path):
    from reshard.sources.hubblob import Blob

    blob = Blob(tmp_path / "etag", 100)
    assert blob.gaps() == [(0, 100)] and not blob.has(0, 1)
    blob.store(memoryview(b"a" * 10), 20)
    blob.store(memoryview(b"b" * 10), 40)
    blob.store(memoryview(b"c" * 10), 30)  # joins the two
    assert blob.has(20, 50) and not blob.has(19, 21) and not blob.has(45, 51)
    assert blob.gaps() == [(0, 20), (50, 100)] and blob.missing() == 70
    blob.close()
    again = Blob(tmp_path / "etag", 100)  # a new run reads what the last one logged
    assert again.gaps() == [(0, 20), (50, 100)]
    out = memoryview(bytearray(30))
    again.pread(out, 20)
    assert bytes(out) == b"a" * 10 + b"c" * 10 + b"b" * 10
    again.store(memoryview(b"d" * 20), 0)
    again.store(memoryview(b"e" * 50), 50)
    assert again.gaps() == [] and again.missing() == 0
    again.publish(tmp_path / "snap" / "model.safetensors")
    again.close()
    assert (
        tmp_path / "snap" / "model.safetensors"
    ).read_bytes() == b"d" * 20 + b"a" * 10 + b"c" * 10 + b"b" * 10 + b"e" * 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etag", "snap"]
