"""Source integrity: every safetensors byte a save reads is checked against the sha256 its publisher
commits to (the Hub's LFS sha256, a `sha256sum` file, `hf download --local-dir` metadata), and a
mismatch is exit 4 naming the file with nothing published. Hub cases run against the project's own
Hub server (tests/fixtures/hubserver.py): a corrupted cache, an ETag-swapping CDN.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.manifest.schema import parse
from tests.fixtures.hubrun import REPO, one_line_error, rank_bytes, reshard, serving, tiny_with_reference

HUB = "hub-lfs-sha256 verified"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-shard tiny checkpoint and `save --tp 2` of it from the folder (the reference)."""
    return tiny_with_reference(tmp_path_factory.mktemp("integrity"), shards=2)


@pytest.fixture
def server(checkpoint):
    with serving(checkpoint[0]) as server:
        yield server


def sha256s(src: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(src.glob("*.safetensors"))}


def source_files(out: Path) -> dict[str, tuple[str | None, str]]:
    """What the manifest says of each source file: (sha256, check)."""
    m = parse(json.loads((out / "reshard.json").read_text()))
    assert m.source_files is not None
    return {f.name: (f.sha256, f.check) for f in m.source_files}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def blobs(home: Path) -> list[Path]:
    return sorted(p for p in (home / "hub").rglob("blobs/*") if len(p.name) == 64)


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_hub_save_records_each_source_files_lfs_sha256(server, checkpoint, tmp_path, mode):
    src, ref = checkpoint
    args = ["--stream"] if mode == "--stream" else []
    p = reshard(server, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", *args)
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert source_files(tmp_path / "out") == {n: (h, HUB) for n, h in sha256s(src).items()}


@pytest.fixture
def corrupt_cache(server, checkpoint, tmp_path):
    """A cached-mode save, then one bit of the last tensor of a complete cached blob flipped (a bad
    persistent CI cache): (HF_HOME, the blob, its file name, the corrupt bytes)."""
    src, _ = checkpoint
    home = tmp_path / "hf"
    p = reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    blob = blobs(home)[-1]
    name = next(n for n, h in sha256s(src).items() if h == blob.name)
    flip(blob, blob.stat().st_size - 1)
    return home, blob, name, blob.read_bytes()


def logs(p: subprocess.CompletedProcess) -> list[str]:
    """stderr's lines but a save's notes (the vLLM releases, the plugin, on stderr too): what the run had to say."""
    return [line for line in p.stderr.splitlines() if not line.startswith("note: ")]


def test_corrupt_cached_blob_offline_is_exit_4_saying_how_to_download_it_again(server, corrupt_cache, tmp_path):
    home, blob, name, bad = corrupt_cache
    p = reshard(server, home, "save", REPO, str(tmp_path / "bad"), "--tp", "2", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, name, "sha256", "HF_HUB_OFFLINE unset", f"hf download {REPO} {name}", "--force-download")
    assert not (tmp_path / "bad").exists()  # nothing published
    assert blob.read_bytes() == bad  # the cache is not touched offline


def dead_owner() -> str:
    """The owner a scratch name of a run that has ended carries (reshard.scratch): as a killed run's."""
    code = "from reshard.scratch import owner; print(owner())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_corrupt_cached_blob_online_is_fetched_again_checked_and_used(server, checkpoint, corrupt_cache, tmp_path):
    """The blob is fetched again into a file beside it: what runs killed while doing so left there is removed,
    a file of a run still going is not."""
    from reshard.scratch import owner

    src, ref = checkpoint
    home, blob, name, bad = corrupt_cache
    killed = blob.with_name(f"{blob.name}.{dead_owner()}.0badf00d.reshard-refetch")
    going = blob.with_name(f"{blob.name}.{owner()}.0badf00d.reshard-refetch")
    killed.write_bytes(bad)
    going.write_bytes(bad)
    held = os.open(blob, os.O_RDONLY)  # a reader that had the blob open before
    try:
        inode = os.fstat(held).st_ino
        p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
        assert p.returncode == 0, p.stderr
        assert len(logs(p)) == 1 and "Traceback" not in p.stderr, p.stderr
        assert f"the cached copy of {REPO}/{name}@" in p.stderr and "fetched it again" in p.stderr, p.stderr
        assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
        assert source_files(tmp_path / "out") == {n: (h, HUB) for n, h in sha256s(src).items()}
        assert blob.read_bytes() == (src / name).read_bytes()  # the cache mended
        # renamed over the blob, not written into it: the open reader still sees the old file whole
        assert os.stat(blob).st_ino != inode and os.pread(held, len(bad) + 1, 0) == bad
    finally:
        os.close(held)
    assert [p.name for p in blob.parent.iterdir() if "." in p.name] == [going.name]  # no temp file left
    going.unlink()
    p = reshard(server, home, "save", REPO, str(tmp_path / "again"), "--tp", "2", HF_HUB_OFFLINE="1")
    assert p.returncode == 0 and logs(p) == [], p.stderr  # offline now finds it good


@pytest.mark.parametrize("etag", ["ABS", "../../../../victim.txt", "not-a-hash"])
def test_an_etag_never_becomes_a_path_outside_the_cache(server, checkpoint, tmp_path, etag):
    """A Hub (or mirror) answering weight files directly under an ETag that is a path: the blob is named by
    the commit's LFS sha256, and the file the ETag names is not touched."""
    src, ref = checkpoint
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    server.direct_etag = str(victim) if etag == "ABS" else etag
    home = tmp_path / "hf"
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert victim.read_text() == "the user's own file"
    assert sorted(b.name for b in blobs(home)) == sorted(sha256s(src).values())
    assert not list(tmp_path.glob("*.reshard-partial")) and not (tmp_path / "victim.txt.reshard-partial").exists()


def test_a_cached_weight_linked_outside_the_cache(server, checkpoint, tmp_path):
    """A snapshot link to a damaged file outside HF_HOME: offline exit 4 (it cannot be checked); online the
    commit's blob is fetched and the link pointed at it, and the file outside is left as it was."""
    src, ref = checkpoint
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    name = sorted(sha256s(src))[0]
    link = next((home / "hub").rglob(f"snapshots/*/{name}"))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(link.read_bytes())
    flip(outside, outside.stat().st_size - 1)
    bad = outside.read_bytes()
    link.unlink()
    link.symlink_to(outside)
    p = reshard(server, home, "save", REPO, str(tmp_path / "off"), "--tp", "2", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, name, "outside the repo's blobs", "HF_HUB_OFFLINE unset")
    p = reshard(server, home, "save", REPO, str(tmp_path / "on"), "--tp", "2")
    assert p.returncode == 0 and "fetched it again" in p.stderr, p.stderr
    assert rank_bytes(tmp_path / "on") == rank_bytes(ref)
    assert outside.read_bytes() == bad  # never written through the link
    assert os.path.basename(os.readlink(link)) == sha256s(src)[name] and link.read_bytes() == (src / name).read_bytes()


def test_swapped_cache_links_are_mended_blob_by_blob(server, checkpoint, tmp_path):
    """Two snapshot links swapped: online each is pointed back at the blob its sha256 names, and no blob is
    left holding another file's bytes (offline then passes)."""
    src, ref = checkpoint
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    a, b = sorted(sha256s(src))[:2]
    la, lb = (next((home / "hub").rglob(f"snapshots/*/{n}")) for n in (a, b))
    ta, tb = os.readlink(la), os.readlink(lb)
    la.unlink(), lb.unlink()
    la.symlink_to(tb), lb.symlink_to(ta)
    p = reshard(server, home, "save", REPO, str(tmp_path / "on"), "--tp", "2")
    assert p.returncode == 0 and rank_bytes(tmp_path / "on") == rank_bytes(ref), p.stderr
    for blob in blobs(home):
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    p = reshard(server, home, "save", REPO, str(tmp_path / "off"), "--tp", "2", HF_HUB_OFFLINE="1")
    assert p.returncode == 0 and logs(p) == [], p.stderr


def test_a_small_file_served_edited_is_exit_4(server, checkpoint, tmp_path):
    """config.json served edited (its size kept) under its usual ETag: it does not hash to
    the commit's git blob id, so nothing is published and the cache keeps nothing of it."""
    src, _ = checkpoint
    config = (src / "config.json").read_text()
    edited = config.replace('"vocab_size": 1000', '"vocab_size": 9000')
    assert edited != config and len(edited) == len(config)
    server.served_instead["config.json"] = edited.encode()
    home = tmp_path / "hf"
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, "config.json", "git blob sha1")
    assert not (tmp_path / "out").exists()
    assert not list((home / "hub").rglob("snapshots/*/config.json"))
    server.served_instead.clear()  # the Hub mended: the next run saves
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "config.json").read_text() == config


def test_small_files_of_another_commit_are_exit_4(server, tmp_path):
    server.commit_said = "e" * 40
    p = reshard(server, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, "config.json", f"served commit {'e' * 40}")
    assert not list((tmp_path / "hf").rglob("snapshots/eeee*"))


def test_an_edited_cached_small_file_is_fetched_again(server, checkpoint, tmp_path):
    src, _ = checkpoint
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    link = next((home / "hub").rglob("snapshots/*/config.json"))
    blob = link.resolve()
    blob.chmod(0o644)
    blob.write_text(blob.read_text().replace('"vocab_size": 1000', '"vocab_size": 9000'))
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert link.read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.parametrize("change", ["cut", "grown"])
def test_a_cached_blob_of_another_size_online_is_fetched_again(server, checkpoint, tmp_path, change):
    """A complete cached blob cut short by 2 bytes (a copy that stopped) or grown by 2: its size is not
    the commit's, so it is fetched again before its header is read (it was exit 4, "truncated", while
    a flipped byte was mended)."""
    src, ref = checkpoint
    home = tmp_path / "hf"
    p = reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    blob = blobs(home)[0]
    name = next(n for n, h in sha256s(src).items() if h == blob.name)
    size = blob.stat().st_size
    blob.chmod(0o644)
    if change == "cut":
        os.truncate(blob, size - 2)
    else:
        with open(blob, "ab") as f:
            f.write(b"\0\0")
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert len(logs(p)) == 1 and f"the cached copy of {REPO}/{name}@" in p.stderr, p.stderr
    assert f"({size + (2 if change == 'grown' else -2)} bytes, the commit's {size})" in p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert blob.read_bytes() == (src / name).read_bytes()


def test_corrupt_cached_blob_online_with_a_hub_serving_other_bytes_too_is_exit_4(server, corrupt_cache, tmp_path):
    home, blob, name, bad = corrupt_cache
    server.swap_after, server.swap_keeps_etag = server.cdn_answers, True  # every answer from now on wrong
    p = reshard(server, home, "save", REPO, str(tmp_path / "bad"), "--tp", "2")
    one_line_error(p, 4, name, "sha256", "other bytes too")
    assert not (tmp_path / "bad").exists()
    assert blob.read_bytes() == bad  # left as it was: no wrong copy swapped in
    assert [p.name for p in blob.parent.iterdir() if "." in p.name] == []


def test_corrupt_partial_blob_is_exit_4_then_downloaded_anew(server, checkpoint, tmp_path):
    src, ref = checkpoint
    home = tmp_path / "hf"
    server.budget = sum(p.stat().st_size for p in src.glob("*.safetensors")) * 2 // 3
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 4, p.stderr
    corrupted = []
    for log in (home / "hub").rglob("*.reshard-ranges"):
        partial = log.with_name(log.name.replace("ranges", "partial"))
        held = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        a, b = max(held, key=lambda r: r[1] - r[0])
        if b - a > 1:
            flip(partial, b - 1)
            corrupted.append(next(n for n, h in sha256s(src).items() if log.name.startswith(h)))
    assert corrupted
    server.budget = None
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, "sha256", "nothing was published")
    assert any(name in p.stderr for name in corrupted), p.stderr
    assert not (tmp_path / "out").exists()
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")  # heals: fetched anew
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert all(b.read_bytes() == (src / n).read_bytes() for n in sha256s(src) for b in blobs(home) if b.name == n)


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
@pytest.mark.parametrize("keeps_etag", [False, True], ids=["new-etag", "lying-etag"])
def test_etag_swapping_cdn_is_exit_4(server, tmp_path, mode, keeps_etag):
    """Later range requests of a file get another file's bytes (same length): a new ETag is caught
    by the pin (If-Match, 412), a CDN that keeps the old ETag by the sha256."""
    server.swap_after, server.swap_keeps_etag = 4, keeps_etag  # the headers come right, the tensors not
    args = ["--stream"] if mode == "--stream" else []
    p = reshard(server, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", *args)
    one_line_error(p, 4, "safetensors", "sha256" if keeps_etag else "other bytes")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "hf").rglob("snapshots/*/*.safetensors"))  # nothing wrong in the cache


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_verify_deep_blames_a_lying_hub_not_the_output(server, tmp_path, mode):
    """A correct output, then a CDN that serves other bytes under the file's ETag: `verify --against --deep`
    is exit 4 naming the source file's sha256 (as a save would), not exit 7 calling the output corrupt;
    and it leaves no wrong partial blob in the cache."""
    args = ["--stream"] if mode == "--stream" else []
    p = reshard(server, tmp_path / "hf0", "save", REPO, str(tmp_path / "out"), "--tp", "2", *args)
    assert p.returncode == 0, p.stderr
    server.swap_after, server.swap_keeps_etag = server.cdn_answers + 4, True  # verify's headers come right
    home = tmp_path / "hf"
    p = reshard(server, home, "verify", str(tmp_path / "out"), "--against", REPO, "--deep")
    one_line_error(p, 4, "safetensors", "sha256")
    assert not list(home.rglob("*.reshard-partial")) and not list(home.rglob("snapshots/*/*.safetensors"))


def test_the_benchmarks_check_off_baseline_hashes_nothing_and_writes_the_same_files(server, checkpoint, tmp_path):
    """`python -m scripts.bench_check off` (make bench's section 6 baseline) is the same save with the
    source hashing replaced by nothing: same rank files, every file `unchecked`, in the three modes it
    times; `on` is the save as shipped. Fails when reshard's hashing moves and the baseline no longer
    turns it off."""
    src, ref = checkpoint
    bench = [sys.executable, "-m", "scripts.bench_check"]
    root = str(Path(__file__).resolve().parents[1])
    for home, more in ((tmp_path / "hf", []), (tmp_path / "hf2", ["--stream"]), (tmp_path / "hf", [])):
        for check, want in (("off", (None, "unchecked")), ("on", None)):
            out = tmp_path / f"out-{check}"
            shutil.rmtree(out, ignore_errors=True)
            args = [*bench, check, "save", REPO, str(out), "--tp", "2", *more]
            env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
            env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(home), RESHARD_DISABLE_PROGRESS="1")
            p = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, (check, more, p.stderr)
            assert rank_bytes(out) == rank_bytes(ref)
            expect = {n: want or (h, HUB) for n, h in sha256s(src).items()}
            assert source_files(out) == expect, (check, more)


# ---- local folders ------------------------------------------------------------------------------


def local_save(src: Path, out: Path, *args: str):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "reshard", "save", str(src), str(out), "--tp", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={"RESHARD_DISABLE_PROGRESS": "1", "PATH": ""})


@pytest.fixture
def folder(checkpoint, tmp_path):
    import shutil

    return Path(shutil.copytree(checkpoint[0], tmp_path / "src"))


def test_local_source_sha256_file(folder, tmp_path):
    sums = sha256s(folder)
    good = tmp_path / "SHA256SUMS"
    good.write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    p = local_save(folder, tmp_path / "out", "--source-sha256", str(good))
    assert p.returncode == 0, p.stderr
    assert source_files(tmp_path / "out") == {n: (h, "sha256-file verified") for n, h in sums.items()}

    name = sorted(sums)[-1]
    flip(folder / name, (folder / name).stat().st_size - 1)
    p = local_save(folder, tmp_path / "out2", "--source-sha256", str(good))
    one_line_error(p, 4, name, "--source-sha256")
    assert not (tmp_path / "out2").exists()

    short = tmp_path / "short"
    short.write_text(good.read_text().splitlines()[0] + "\n")
    # the option's file itself wrong: a usage error (exit 2), as a missing one is (click's check)
    one_line_error(local_save(folder, tmp_path / "out3", "--source-sha256", str(short)), 2, "lists no sha256")
    bad = tmp_path / "bad"
    bad.write_text("not a checksum\n")
    one_line_error(
        local_save(folder, tmp_path / "out3", "--source-sha256", str(bad)), 2, "bad:1: not a `sha256sum` line"
    )
    assert not (tmp_path / "out3").exists()


def test_local_hf_download_metadata_is_used_else_unchecked(folder, tmp_path):
    p = local_save(folder, tmp_path / "plain")
    assert p.returncode == 0, p.stderr
    assert set(source_files(tmp_path / "plain").values()) == {(None, "unchecked")}

    sums = sha256s(folder)
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for n, h in sums.items():  # as `hf download --local-dir` leaves it: commit, etag, timestamp
        (meta / f"{n}.metadata").write_text(f"{'a' * 40}\n{h}\n1764662400.0\n")
    p = local_save(folder, tmp_path / "out")
    assert p.returncode == 0, p.stderr
    assert source_files(tmp_path / "out") == {n: (h, "hf-metadata-sha256 verified") for n, h in sums.items()}

    name = sorted(sums)[0]
    flip(folder / name, (folder / name).stat().st_size - 1)
    one_line_error(local_save(folder, tmp_path / "out2"), 4, name, ".cache/huggingface")
    assert not (tmp_path / "out2").exists()


def test_manifest_source_files_round_trip_and_old_manifests_parse(checkpoint):
    old = json.loads((checkpoint[1] / "reshard.json").read_text())
    old.pop("source_files", None)
    assert parse(old).source_files is None
    new = {**old, "source_files": [{"name": "a.safetensors", "size": 3, "sha256": None, "check": "unchecked"}]}
    assert parse(parse(new).to_json()).source_files == parse(new).source_files
