"""What reshard puts into huggingface_hub's cache is the Hub's bytes, and what it reads from there is
checked: other tools (transformers, `vllm serve REPO`) trust a blob's name. A partial blob an earlier
run left is published only if its own bytes hash to its name; offline, a cached small file is checked
against the git blob sha1 its blob is named by; safetensors files stored in git (not LFS) are checked
against theirs. Runs against the project's Hub server (tests/fixtures/hubserver.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from reshard.manifest.schema import parse
from tests.fixtures.hubrun import REPO, one_line_error, rank_bytes, reshard, serving, tiny_with_reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_with_reference(tmp_path_factory.mktemp("hubcache"), shards=2)


@pytest.fixture
def server(checkpoint):
    with serving(checkpoint[0]) as server:
        yield server


def blobs(home: Path) -> list[Path]:
    return sorted(p for p in (home / "hub").rglob("blobs/*") if len(p.name) in (40, 64))


def source_files(out: Path) -> dict[str, tuple[str | None, str]]:
    """What the manifest says of each source file: (sha256, check)."""
    m = parse(json.loads((out / "reshard.json").read_text()))
    assert m.source_files is not None
    return {f.name: (f.sha256, f.check) for f in m.source_files}


def heads(src: Path) -> int:
    """The bytes of every weight file's length and header together (what planning fetches)."""
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in src.glob("*.safetensors"))


def test_a_partial_blob_whose_header_is_not_the_hubs_is_never_published_under_its_sha256(server, checkpoint, tmp_path):
    """Run 1 gets the headers, then the CDN serves nothing more (exit 4, the partial blobs kept). One
    header in a partial blob then says F16 where the Hub's says BF16 (as a lying CDN could have left it).
    Run 2, against an honest Hub, must not rename that blob to blobs/<sha256>: it was (its output right,
    the cached file wrong) because the header hashed was the one fetched, not the one in the blob."""
    src, ref = checkpoint
    home = tmp_path / "hf"
    server.budget = heads(src)
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 4, p.stderr
    partial = sorted((home / "hub").rglob("*.reshard-partial"))[0]
    head = partial.read_bytes()[:512]
    lie = head.replace(b'"dtype":"BF16",', b'"dtype":"F16" ,', 1)
    assert lie != head
    with open(partial, "r+b") as f:
        f.write(lie)
    server.budget = None
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    names = {hashlib.sha256(f.read_bytes()).hexdigest(): f.read_bytes() for f in src.glob("*.safetensors")}
    assert {b.name: b.read_bytes() for b in blobs(home) if len(b.name) == 64} == names


def test_a_complete_blob_whose_header_is_not_the_hubs_is_not_linked(server, checkpoint, tmp_path):
    """A complete blobs/<sha256> the snapshot does not link yet (a run stopped between the two), its
    header edited: it is not linked as the commit's file (it was: only its other bytes were hashed)."""
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    blob = next(b for b in blobs(home) if len(b.name) == 64)
    link = next(p for p in (home / "hub").rglob("snapshots/*/*.safetensors") if p.resolve() == blob)
    link.unlink()
    data = blob.read_bytes()
    blob.chmod(0o644)
    blob.write_bytes(data.replace(b'"dtype":"BF16",', b'"dtype":"F16" ,', 1))
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    one_line_error(p, 4, link.name, str(blob))
    assert not link.exists() and not (tmp_path / "out").exists()


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def git_stored(checkpoint, tmp_path, monkeypatch):
    """The Hub serving the checkpoint's safetensors files as files stored in git, not LFS (no `lfs` entry;
    their ETag and blob id are their git blob sha1): an honest commit, then one whose last file has a
    byte flipped near its end while its ETag and blob id still name the honest bytes (served edited)."""
    from tests.fixtures import hubserver

    monkeypatch.setattr(hubserver, "LFS_SUFFIXES", (".bin",))
    src, _ = checkpoint
    lie = tmp_path / "lie"
    shutil.copytree(src, lie)
    last = sorted(lie.glob("*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-50] ^= 0x01
    last.write_bytes(bytes(data))
    with serving(src) as server:
        honest = server.sha
        server.sha = server.add_repo(REPO, lie, branch="lie")
        server.repos[REPO].etags[(server.sha, last.name)] = git_sha1((src / last.name).read_bytes())
        yield server, honest, last.name


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_safetensors_stored_in_git_are_checked_against_their_git_blob_sha1(checkpoint, git_stored, tmp_path, mode):
    """Served edited, they were saved with exit 0 and `check: unchecked`; now exit 4 naming the file and
    nothing published (no output, nothing in the cache under the commit's names). Served right, the
    manifest says they were checked."""
    src, ref = checkpoint
    server, _, edited = git_stored
    args = ["--stream"] if mode == "--stream" else []
    home = tmp_path / "hf"
    p = reshard(server, home, "save", REPO, str(tmp_path / "bad"), "--tp", "2", "--revision", "lie", *args)
    one_line_error(p, 4, edited, "git blob sha1")
    assert not (tmp_path / "bad").exists()
    assert not list((home / "hub").rglob("snapshots/*/*.safetensors"))
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2", *args)
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    files = {f.name: f.read_bytes() for f in sorted(src.glob("*.safetensors"))}
    want = {n: (hashlib.sha256(d).hexdigest(), "hub-git-sha1 verified") for n, d in files.items()}
    assert source_files(tmp_path / "out") == want
    if mode == "--no-stream":  # cached under their git blob sha1, as huggingface_hub names such blobs
        links = {p.name: p.resolve() for p in (home / "hub").rglob("snapshots/*/*.safetensors")}
        assert {n: (b.name, b.read_bytes()) for n, b in links.items()} == {
            n: (git_sha1(d), d) for n, d in files.items()
        }


def test_an_edited_cached_small_file_offline_is_exit_4(server, checkpoint, tmp_path):
    """After an online save, config.json's blob edited (rms_norm_eps; its name, the git blob sha1, kept): offline, the
    save and `verify --against REPO --deep` used it unchecked (exit 0, an output with the edited config
    and a manifest naming the commit). Now both are exit 4 saying how to get it again, as for weights."""
    src, _ = checkpoint
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    blob = next((home / "hub").rglob("snapshots/*/config.json")).resolve()
    assert blob.name == git_sha1((src / "config.json").read_bytes())
    blob.chmod(0o644)
    edited = blob.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0.1')
    assert edited != blob.read_text()
    blob.write_text(edited)
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, f"{REPO}/config.json@{server.sha[:12]}", "git blob sha1", "--force-download")
    assert not (tmp_path / "out").exists()
    p = reshard(server, home, "verify", str(tmp_path / "good"), "--against", REPO, "--deep", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, f"{REPO}/config.json@{server.sha[:12]}", "git blob sha1")
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")  # online: fetched again
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    p = reshard(server, home, "save", REPO, str(tmp_path / "off"), "--tp", "2", HF_HUB_OFFLINE="1")
    assert p.returncode == 0 and _warnings(p.stderr) == [], p.stderr


def test_cached_safetensors_stored_in_git_are_checked_against_their_blob_names(checkpoint, git_stored, tmp_path):
    """A cached-mode save of files stored in git, then one blob edited (its name, the git blob sha1, kept):
    offline it is exit 4 (it was read unchecked); online it is fetched again (it was used as it was).
    Right, the manifest says how each file was checked, offline too."""
    src, ref = checkpoint
    server, honest, edited = git_stored
    home = tmp_path / "hf"
    assert reshard(server, home, "save", REPO, str(tmp_path / "good"), "--tp", "2").returncode == 0
    files = {f.name: f.read_bytes() for f in sorted(src.glob("*.safetensors"))}
    p = reshard(server, home, "save", REPO, str(tmp_path / "off"), "--tp", "2", HF_HUB_OFFLINE="1")
    assert p.returncode == 0 and _warnings(p.stderr) == [], p.stderr
    checked = {n: (hashlib.sha256(d).hexdigest(), "hub-cache-blob-git-sha1 verified") for n, d in files.items()}
    assert source_files(tmp_path / "off") == checked
    blob = home / "hub" / "models--acme--tiny-qwen3" / "blobs" / git_sha1(files[edited])
    data = bytearray(files[edited])
    data[-50] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    p = reshard(server, home, "save", REPO, str(tmp_path / "bad"), "--tp", "2", HF_HUB_OFFLINE="1")
    one_line_error(p, 4, f"{REPO}/{edited}@{honest[:12]}", "git blob sha1", "--force-download")
    assert not (tmp_path / "bad").exists()
    p = reshard(server, home, "save", REPO, str(tmp_path / "out"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    assert blob.read_bytes() == files[edited]
    checked = {n: (hashlib.sha256(d).hexdigest(), "hub-git-sha1 verified") for n, d in files.items()}
    assert source_files(tmp_path / "out") == checked


def _warnings(stderr: str) -> list[str]:
    """stderr's lines but the notes a save always prints there (the vLLM range, the plugin)."""
    return [line for line in stderr.splitlines() if not line.startswith("note: ")]
