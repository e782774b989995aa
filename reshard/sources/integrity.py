"""Source integrity: each safetensors file's sha256 against what its publisher commits to.

Where the expected sha256 comes from, and the `check` the manifest records for the file:
- a Hub repo: the LFS sha256 of the commit's file (model info with file metadata; the Hub's
  `X-Linked-Etag` says the same) -> HUB. Offline, a file of huggingface_hub's cache is checked
  against its blob's name, which is the ETag (the LFS sha256) it was downloaded under -> CACHE.
  A file stored in git, not LFS: its git blob sha1 (the model info's blob id) -> GIT, offline its
  blob's name -> CACHE_GIT (reshard.sources.hubsource, reshard.sources.hub).
- a local folder: `save --source-sha256 FILE` (`sha256sum` lines) -> SHA256_FILE; else the
  `.cache/huggingface/download/<name>.metadata` that `hf download --local-dir` leaves -> HF_METADATA;
  else nothing is checked -> UNCHECKED.

A mismatch is a SourceError (exit 4) naming the file, raised before the save publishes anything;
a source that can mend one (a Hub cache online: `reshard.sources.hub.refetch`) passes `check_files`
a `Fix`, which fetches the file again or raises the error that says what to do.
A Hub file read by ranges is hashed from the ranges the save reads (reshard.sources.prefixhash).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from reshard.errors import SourceError, UsageError
from reshard.manifest.schema import SourceFileRecord

HUB = "hub-lfs-sha256 verified"
CACHE = "hub-cache-blob-sha256 verified"
SHA256_FILE = "sha256-file verified"
HF_METADATA = "hf-metadata-sha256 verified"
RECORDED = "recorded-sha256 verified"  # verify --against --deep: the sha256 the output's save checked
UNCHECKED = "unchecked"
GIT = "hub-git-sha1 verified"  # a safetensors file stored in git, not LFS: its git blob sha1 (the blob id)
CACHE_GIT = "hub-cache-blob-git-sha1 verified"  # offline: the git blob sha1 its cache blob is named by
CHECKS = (HUB, CACHE, SHA256_FILE, HF_METADATA, RECORDED, UNCHECKED, GIT, CACHE_GIT)

_HEX = re.compile(r"^[0-9a-f]{64}$")

Expected = dict[str, tuple[str, str]]  # file -> (sha256, the check it counts as)
# (file, the sha256 it hashed to, the one expected): put bytes that hash to the expected sha256 in its
# place (checked before they replace the file), or raise the SourceError that says what to do
Fix = Callable[[str, str, str], None]


def is_sha256(text: str | None) -> bool:
    return bool(text) and bool(_HEX.match(text or ""))


_SAYS = {
    HUB: "the LFS sha256 the Hub commits to",
    CACHE: "the sha256 its cache blob is named by",
    SHA256_FILE: "the sha256 --source-sha256 lists",
    HF_METADATA: "the sha256 in .cache/huggingface",
    RECORDED: "the sha256 the output's manifest records for its source (SOURCE changed since the save?)",
}


def mismatch(where: str, got: str, want: str, how: str, hint: str) -> SourceError:
    says = _SAYS.get(how, how)
    return SourceError(f"{where}: sha256 {got[:12]}… is not {says} ({want[:12]}…): corrupt or changed", hint)


def read_sha256_file(path: Path) -> dict[str, str]:
    """`sha256sum` output (`<hex>  <name>` or `<hex> *<name>` lines): name -> sha256."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--source-sha256 {path}: cannot read ({e})", "give a readable `sha256sum` file") from e
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line.strip())
        if not m:
            raise UsageError(f"--source-sha256 {path}:{n}: not a `sha256sum` line", "write it with `sha256sum FILES`")
        name, sha = os.path.basename(m.group(2).removeprefix("./")), m.group(1).lower()
        if out.setdefault(name, sha) != sha:  # `sha256sum -c` would fail one of the two
            raise UsageError(
                f"--source-sha256 {path}:{n}: a second, different sha256 for {name}",
                "keep one line per file (`sha256sum` of the files as they should be)",
            )
    return out


def recorded_expected(records: tuple[SourceFileRecord, ...] | None, files: list[str]) -> Expected:
    """The sha256 a save checked each source file against, as its manifest records them: what `verify
    --against SOURCE --deep` expects of SOURCE's files of the same names (a changed source is its fault)."""
    have = set(files)
    return {r.name: (r.sha256, RECORDED) for r in records or () if r.name in have and is_sha256(r.sha256)}


def local_expected(root: Path, files: list[str], sha_file: Path | None) -> Expected:
    """What each local file is expected to hash to (see the module docstring)."""
    listed = read_sha256_file(sha_file) if sha_file is not None else {}
    if sha_file is not None:
        missing = [f for f in files if f not in listed]
        if missing:
            raise UsageError(
                f"--source-sha256 {sha_file} lists no sha256 for {', '.join(missing[:3])}",
                "list every safetensors file of the source (`sha256sum *.safetensors`)",
            )
    out: Expected = {}
    for name in files:
        if name in listed:
            out[name] = (listed[name], SHA256_FILE)
        elif (etag := _hf_metadata_etag(root, name)) is not None:
            out[name] = (etag, HF_METADATA)
    return out


def _hf_metadata_etag(root: Path, name: str) -> str | None:
    """The sha256 `hf download --local-dir` recorded for `name` (commit, etag, timestamp lines)."""
    try:
        lines = (root / ".cache" / "huggingface" / "download" / f"{name}.metadata").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    etag = lines[1].strip().strip('"').lower() if len(lines) > 1 else ""
    return etag if is_sha256(etag) else None


def cache_expected(root: Path, files: list[str]) -> Expected:
    """Offline: each cached file's blob name, the LFS sha256 huggingface_hub downloaded it under."""
    out: Expected = {}
    for name in files:
        blob = os.path.basename(os.readlink(root / name)) if (root / name).is_symlink() else ""
        if is_sha256(blob):
            out[name] = (blob, CACHE)
    return out


def check_files(
    root: Path, files: list[str], sizes: dict[str, int], expected: Expected, fix: Fix | None = None
) -> list[SourceFileRecord]:
    """Hash each file that has an expected sha256 (one sequential read each); on a mismatch `fix` it,
    or without one exit 4."""
    from reshard.hashing import hash_file

    out = []
    for name in files:
        if name not in expected:
            out.append(SourceFileRecord(name, sizes.get(name, 0), None, UNCHECKED))
            continue
        want, how = expected[name]
        try:
            got = hash_file(root / name, "sha256")
        except OSError as e:
            raise SourceError(f"{root / name}: cannot read ({e.strerror})") from e
        assert got is not None
        if got != want and fix is not None:
            fix(name, got, want)  # raised, or put a checked copy in place
            got = want
        if got != want:
            path = os.path.realpath(root / name)
            raise mismatch(
                str(root / name), got, want, how, f"download the file again (delete {path} if it is a cached copy)"
            )
        out.append(SourceFileRecord(name, sizes.get(name, 0), got, how))
    return out


def whole_digests(read: Callable[[int, memoryview], None], size: int, block: int = 64 << 20) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file's bytes, read by `read(pos, out)` in blocks."""
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    for pos in range(0, size, block):
        buf = memoryview(bytearray(min(block, size - pos)))
        read(pos, buf)
        sha256.update(buf)
        sha1.update(buf)
    return sha256.hexdigest(), sha1.hexdigest()
