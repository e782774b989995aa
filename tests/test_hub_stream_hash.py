"""`save --stream` from a lying CDN: the sha256 checked against the Hub's LFS sha256 vouches for every
byte the rank files were written from (reshard.sources.prefixhash, .hubgroups, .hubshare), so a
CDN that serves a range wrong once, and right when it is fetched again, is exit 4 with nothing
published, however the save's reads fall:

- used bytes after an unused tensor (a rotary `inv_freq`, MTP layers, a vision tower skipped by
  --language-model-only) wait for the hash; too many to hold, their digests are kept and the bytes
  fetched again for the hash must match them;
- a group of small tensors dropped from memory and fetched again must match its first fetch;
- bytes several reads use (Llama-4's q/k rows, read as even and odd rows per head) are fetched and
  hashed once, or, not kept, fetched again and compared with their first fetch.

Saves run in-process (the hash's, the groups' and the shared bytes' limits made small by monkeypatch),
against the project's Hub server (tests/fixtures/hubserver.py) with its `corrupt` hook.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.sources import hubgroups, prefixhash
from tests.fixtures.cli import run
from tests.fixtures.hubrun import REPO, rank_bytes, serving, tiny_with_reference

UNUSED = "model.layers.0.self_attn.rotary_emb.inv_freq"  # a tensor no rank reads


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny qwen3 (its reference `save --tp 2`), and a copy whose first tensor is UNUSED."""
    base = tmp_path_factory.mktemp("streamhash")
    src, ref = tiny_with_reference(base, shards=1)
    unused = base / "unused"
    unused.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors":
            (unused / p.name).write_bytes(p.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors[UNUSED] = torch.arange(16 * 1024, dtype=torch.float32)  # F32: before the BF16 tensors
    save_file(tensors, unused / "model.safetensors", metadata={"format": "pt"})
    return src, ref, unused


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """`hub(folder)`: the Hub server with `folder` as REPO, huggingface_hub pointed at it and at a cache
    of this test's own, in this process."""
    import huggingface_hub.constants as constants

    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for k, v in {"RESHARD_HUB_BACKOFF": "0.01", "RESHARD_HUB_RETRIES": "3", "RESHARD_DISABLE_PROGRESS": "1"}.items():
        monkeypatch.setenv(k, v)
    servers = []

    def start(folder: Path):
        server = serving(folder)
        servers.append(server)
        hub = server.__enter__()
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        return hub

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def unused_bytes(path: Path) -> tuple[int, int]:
    """Where UNUSED's bytes are in the file, [start, end): the first tensor's."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8 : 8 + n])[UNUSED]["data_offsets"]
    assert (a, b) == (0, 64 * 1024)
    return 8 + n + a, 8 + n + b


@pytest.mark.parametrize(
    ("pending", "spill"), [(None, None), (4096, None), (4096, "0")], ids=["held", "spilled", "too-many-to-hold"]
)
def test_used_bytes_after_an_unused_tensor_served_wrong_are_exit_4(
    checkpoint, hub, monkeypatch, tmp_path, pending, spill
):
    """The CDN flips every range after the unused tensor until the hash reads the unused tensor, then
    serves honest bytes (F1)."""
    _, _, src = checkpoint
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")  # each tensor its own range, as large ones are
    if pending is not None:
        monkeypatch.setattr(prefixhash, "PENDING", pending)
    if spill is not None:
        monkeypatch.setenv("RESHARD_STREAM_SPILL", spill)
    gap = unused_bytes(src / "model.safetensors")
    server = hub(src)
    honest, lies = [], []

    def corrupt(name: str, start: int, end: int) -> bool:
        if gap[0] <= start < gap[1]:  # the hash's own read of what no rank used: honest from here on
            honest.append(start)
        if not honest and start >= gap[1]:
            lies.append(start)
        return not honest and start >= gap[1]

    server.corrupt = corrupt
    code, out, err = run("save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    assert (code, out) == (4, ""), err
    assert lies and honest  # the premise: used bytes served wrong, then the unused ones read for the hash
    [line] = [line for line in err.splitlines() if not line.startswith("note: --stream: ")]
    assert line.startswith(f"reshard: error: {REPO}/model.safetensors@{server.sha[:12]}: ")
    if spill is None:  # what was held (in memory or on disk) is hashed from the bytes used: the sha256 is wrong
        assert "is not the LFS sha256 the Hub commits to" in line
    else:  # what could not be held was used wrong and fetched again right
        assert "the download served other bytes for bytes " in line
    assert not (tmp_path / "out").exists()


def test_used_bytes_after_an_unused_tensor_are_fetched_once(checkpoint, hub, monkeypatch, tmp_path):
    """The honest run: every byte fetched once (what was held is not fetched again; the unused tensor is
    fetched for the hash only), and the rank files are the reference's."""
    _, ref, src = checkpoint
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    server = hub(src)
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    assert code == 0, err
    assert server.served == (src / "model.safetensors").stat().st_size
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)


@pytest.fixture
def tiny_groups(monkeypatch):
    """Groups of at most 64 KiB, one kept at a time: the tiny qwen3's groups are dropped and fetched again."""
    monkeypatch.setattr(hubgroups, "GROUP", 64 * 1024)
    monkeypatch.setattr(hubgroups, "KEEP", 1)


def test_a_group_served_wrong_when_fetched_again_is_exit_4(checkpoint, hub, tiny_groups, tmp_path):
    """The CDN serves any range it has served before with bits flipped (F2)."""
    src, _, _ = checkpoint
    server = hub(src)
    seen: set[tuple[int, int]] = set()
    again = []

    def corrupt(name: str, start: int, end: int) -> bool:
        if (start, end) in seen:
            again.append((start, end))
            return True
        seen.add((start, end))
        return False

    server.corrupt = corrupt
    code, out, err = run("save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    assert again  # the premise: a group was fetched again
    assert (code, out) == (4, ""), err
    [line] = err.splitlines()
    a, b = again[0]
    assert line == (
        f"reshard: error: {REPO}/model.safetensors@{server.sha[:12]}: the download served other bytes for bytes "
        f"{a}-{b} than it served before (run again later; if it persists, the Hub's CDN serves a changed file: "
        "report it (nothing was published))"
    )
    assert not (tmp_path / "out").exists()


def test_groups_fetched_again_honestly_give_the_reference_bytes_without_a_second_pass(
    checkpoint, hub, tiny_groups, tmp_path
):
    """Each byte fetched once, but for the groups fetched again: checked by their digests, not by
    downloading the file once more."""
    src, ref, _ = checkpoint
    server = hub(src)
    seen: set[tuple[int, int]] = set()
    again = []

    def count(name: str, start: int, end: int) -> bool:
        if (start, end) in seen:
            again.append(end - start)
        seen.add((start, end))
        return False

    server.corrupt = count
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    assert code == 0, err
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert again  # the premise: groups fetched again
    assert server.served == (src / "model.safetensors").stat().st_size + sum(again)


# ---- bytes several reads use (reshard.sources.hubshare) ------------------------------------------------
# The tiny Llama-4 at TP 4: each head's q and k rows read twice (its even rows, then its odd rows: vLLM's
# rotary order) and its 2 KV heads read by two ranks each. Each tensor its own request (RESHARD_HUB_SMALL=0),
# as a release's are: they are megabytes.


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """The tiny Llama-4, its `save --tp 4` from the folder, and the file's ranges the save reads."""
    from reshard.layout import Layout
    from reshard.plan import DEFAULT_MAX_PART, build_plan
    from reshard.schedule import DEFAULT_CHUNK, schedule
    from reshard.sources import open_source
    from tests.fixtures.saving import save
    from tests.fixtures.tiny import make_tiny

    base = tmp_path_factory.mktemp("llama4share")
    src = make_tiny("llama4", base / "src")
    save(str(src), base / "ref", tp=4, max_part_size=DEFAULT_MAX_PART)
    ckpt = open_source(str(src)).checkpoint
    steps = schedule(build_plan(ckpt, Layout(tp=4)), ckpt.tensors, DEFAULT_CHUNK)
    reads = [(r.info.offset + r.start, r.info.offset + r.start + r.nbytes) for s in steps for r in s.reads]
    return src, base / "ref", reads


def times_read(path: Path, reads: list[tuple[int, int]]) -> bytearray:
    """How many of `reads` hold each byte of the file."""
    times = bytearray(path.stat().st_size)
    for a, b in reads:
        for i in range(a, b):
            times[i] += 1
    return times


def test_llama4_bytes_read_twice_are_fetched_once(llama4, hub, monkeypatch, tmp_path):
    """The honest run fetches the file once (each byte read twice was fetched again, and the
    whole file fetched again to prove them: 2.2x), and writes the reference's bytes."""
    src, ref, reads = llama4
    file = src / "model.safetensors"
    assert max(times_read(file, reads)) == 4  # the premise: a KV head's rows read by 2 ranks, twice each
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    server = hub(src)
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "4", "--stream")
    assert code == 0, err
    assert server.served == file.stat().st_size
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)


def test_llama4_bytes_not_kept_are_fetched_again_and_the_file_not(llama4, hub, monkeypatch, tmp_path):
    """With no byte kept for the reads after the first, each read fetches its bytes: the bytes read twice
    are fetched twice, checked against the first fetch, and the file is not fetched a second time."""
    from reshard.sources import hubshare

    src, ref, reads = llama4
    file = src / "model.safetensors"
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    monkeypatch.setattr(hubshare, "KEEP", 0)
    server = hub(src)
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "4", "--stream")
    assert code == 0, err
    again = sum(max(0, n - 1) for n in times_read(file, reads))
    assert again and server.served == file.stat().st_size + again
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)


@pytest.mark.parametrize(
    "keep, lie",
    [(True, "first"), (False, "first"), (False, "again")],
    ids=["kept-lied-first", "fetched-again-lied-first", "fetched-again-lied-again"],
)
def test_llama4_bytes_read_twice_served_wrong_once_are_exit_4(llama4, hub, monkeypatch, tmp_path, keep, lie):
    """The CDN flips the bytes of each request holding bytes the save reads twice, on its first request of
    them or on the next; the other requests, and the rest of each, are honest."""
    from reshard.sources import hubshare

    src, _, reads = llama4
    twice = times_read(src / "model.safetensors", reads)
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    if not keep:
        monkeypatch.setattr(hubshare, "KEEP", 0)
    server = hub(src)
    served = bytearray(len(twice))
    lies = []

    def corrupt(name: str, start: int, end: int) -> bool:
        shared = max(twice[start:end], default=0) > 1
        again = any(served[start:end])
        served[start:end] = b"\x01" * (end - start)
        if shared and again == (lie == "again"):
            lies.append((start, end))
            return True
        return False

    server.corrupt = corrupt
    code, out, err = run("save", REPO, str(tmp_path / "out"), "--tp", "4", "--stream")
    assert lies  # the premise
    assert (code, out) == (4, ""), err
    [line] = err.splitlines()
    assert line.startswith(f"reshard: error: {REPO}/model.safetensors@{server.sha[:12]}: ")
    if keep:  # the bytes kept are the bytes hashed: the sha256 is wrong
        assert "is not the LFS sha256 the Hub commits to" in line
    else:  # fetched again, the bytes differ from the first fetch's
        assert "the download served other bytes for bytes " in line
    assert not (tmp_path / "out").exists()


# ---- reads far out of file order (an MoE's experts, stored by name) -----------------------------------


def test_taken_again_is_what_the_hasher_takes_in_again():
    """`prefixhash.taken_again` (the start-of-run estimate) counts exactly the bytes `rest` reads again when
    a file's ranges come in that order, held within the same bound."""
    import random

    rng = random.Random(7)
    size, pending = 1 << 20, 96 << 10
    cuts = sorted(rng.sample(range(1, size), 300))
    ranges = list(zip([0, *cuts], [*cuts, size], strict=True))
    for trial in range(20):
        order = ranges[:]
        if trial:  # the first in file order: nothing again
            for _ in range(trial * 10):
                i, j = rng.randrange(len(order)), rng.randrange(len(order))
                order[i], order[j] = order[j], order[i]
        data = rng.randbytes(size)
        taken = []

        def read(pos, out, data=data, taken=taken):
            out[:] = data[pos : pos + len(out)]
            taken.append(len(out))

        hasher = prefixhash.PrefixHasher(size)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(prefixhash, "PENDING", pending)
            for a, b in order:
                hasher.feed(a, data[a:b])
            assert hasher.rest(read) == __import__("hashlib").sha256(data).hexdigest()
        assert sum(taken) == prefixhash.taken_again((("f", a, b) for a, b in order), pending)
        assert trial or not taken


def test_an_moe_streamed_out_of_file_order_is_told_and_fetches_what_it_said(hub, monkeypatch, tmp_path):
    """The tiny Qwen3-MoE's experts are stored by name (expert 10 before expert 2) and read by number; with a
    hash buffer too small for them, `--stream` fetches them again for the sha256: the run says how much
    before it starts, and fetches that much on top of the file (each tensor its own request, on one
    connection: fed in the order they are made), writing the folder's bytes."""
    from reshard.console import human_bytes
    from tests.fixtures.saving import save
    from tests.fixtures.tiny import make_tiny

    src = make_tiny("qwen3-moe", tmp_path / "src")
    save(str(src), tmp_path / "ref", tp=2)
    monkeypatch.setenv("RESHARD_HUB_CONNECTIONS", "1")  # reads fed in the order they are made
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    monkeypatch.setenv("RESHARD_STREAM_SPILL", "0")  # nothing waits on disk (tests/test_spill.py: what does)
    monkeypatch.setattr(prefixhash, "PENDING", 64 * 1024)
    server = hub(src)
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream")
    assert code == 0, err
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    notes = [line for line in err.splitlines() if line.startswith("note: --stream: ")]
    assert len(notes) == 1, err
    again = server.served - size
    assert again > size // 4  # the premise: much fetched again
    assert f"about {human_bytes(again)} of its " in notes[0]
    assert rank_bytes(tmp_path / "out") == rank_bytes(tmp_path / "ref")
