"""A Hub repo id: read from the Hub as the save consumes it, or from huggingface_hub's cache.

- HF_HUB_OFFLINE: the cache only (`snapshot_download(local_files_only=True)`), as before.
- Online: the revision is pinned to its commit (`reshard.sources.hubhttp.HubRepo`); a snapshot of
  that commit complete in the cache is read as a local folder; otherwise a `HubSource` plans from
  config.json and headers fetched by range, and streams the weights (`reshard.sources.hubsource`):
  cached as it goes (default) or not stored at all (`stream`).
- The Hub unreachable (after retries): the cache, if it has the revision.

A cached file that does not hash to the sha256 the commit holds (a bad persistent CI cache) is
fetched again when the Hub is reachable (`refetch`: into a file of its own, checked, then renamed
over the blob, as huggingface_hub downloads: a reader sees the old blob or the new one, whole);
from the cache alone it is exit 4 saying how to download it again, and so is a small file (config.json,
the tokenizer, ...) that does not hash to its blob's name (reshard.sources.hubsmall.check_cached).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.console import log_line
from reshard.errors import SourceError
from reshard.names import CONFIG, HUB_PATTERNS, INDEX, SINGLE
from reshard.sources.local import LocalSource
from reshard.sources.validate import check_index

if TYPE_CHECKING:
    from reshard.sources.hubhttp import HubRepo

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not os.path.exists(spec)


def open_hub(repo_id: str, revision: str | None, *, headers_only: bool, stream: bool = False):
    """The Source for `repo_id` at `revision` (see the module docstring)."""
    from huggingface_hub import constants as hub_constants

    from reshard.sources.hubhttp import HubRepo, Unreachable

    if hub_constants.HF_HUB_OFFLINE:
        return _from_cache(repo_id, revision)
    try:
        repo = HubRepo(repo_id, revision)
    except Unreachable:
        try:
            return _from_cache(repo_id, revision)
        except SourceError:
            pass
        raise
    return _online(repo, headers_only=headers_only, stream=stream)


def weight_names(repo: HubRepo, root: Path) -> list[str]:
    """The repo's safetensors files, as `reshard.sources.local.weight_files` picks them."""
    if INDEX in repo.files:
        try:
            files = check_index(json.loads((root / INDEX).read_text()), f"{repo.repo_id}/{INDEX}")
        except (OSError, ValueError, RecursionError) as e:
            raise SourceError(f"{repo.repo_id}/{INDEX}: cannot parse ({e})") from e
        missing = [f for f in files if f not in repo.files]
        if missing:
            raise SourceError(
                f"{repo.repo_id}@{repo.commit[:12]}: {INDEX} names files the repo lacks: {', '.join(missing[:3])}"
            )
        return files
    if SINGLE in repo.files:
        return [SINGLE]
    found = sorted(
        f for f in repo.files if f.endswith(".safetensors") and "/" not in f and not f.startswith("consolidated")
    )
    if not found:
        raise SourceError(f"{repo.repo_id}: no *.safetensors weights in the repo", "reshard reads safetensors only")
    return found


def _online(repo, *, headers_only: bool, stream: bool):
    from fnmatch import fnmatch

    from reshard.sources import hubsmall
    from reshard.sources.hubsource import HubSource

    if CONFIG not in repo.files:
        raise SourceError(
            f"{repo.repo_id}@{repo.commit[:12]}: no {CONFIG} in the repo", "is it a transformers model repo?"
        )
    small = [
        f
        for f in repo.files
        if "/" not in f and not f.endswith(".safetensors") and any(fnmatch(f, p) for p in HUB_PATTERNS)
    ]
    root = None
    for name in [CONFIG, *[f for f in small if f != CONFIG]]:
        path = Path(hubsmall.download(repo, name))
        root = root or path.parent
    assert root is not None
    files = weight_names(repo, root)
    ref = {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit}
    if all((root / f).is_file() for f in files):  # complete in the cache: a local folder, checked before use
        from reshard.sources.integrity import GIT, HUB, cache_expected

        expected = cache_expected(root, files)  # the blob names, unless the commit says otherwise:
        expected.update({f: (repo.lfs[f], HUB) for f in files if f in repo.lfs})
        for f in files:  # stored in git: checked as a small file is (fetched again where it is not the commit's)
            if f not in repo.lfs and hubsmall.expected(None, repo.blob_ids.get(f)):
                expected[f] = (hashlib.sha256(Path(hubsmall.download(repo, f)).read_bytes()).hexdigest(), GIT)
        for f in files:  # cut short or grown: fetched again before its header is read (and refused)
            size = (root / f).stat().st_size
            if f in repo.lfs and repo.lfs_size.get(f, size) != size:
                refetch(repo, root, f, "", repo.lfs[f], why=f"{size} bytes, the commit's {repo.lfs_size[f]}")
        return LocalSource(root, ref, expected, fix=lambda name, got, want: refetch(repo, root, name, got, want))
    return HubSource(repo, root, files, stream=stream)


def _from_cache(repo_id: str, revision: str | None) -> LocalSource:
    import huggingface_hub as hub
    from huggingface_hub import errors as hub_errors

    try:
        folder = hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS), local_files_only=True
        )
    except hub_errors.LocalEntryNotFoundError as e:
        at = f"{repo_id}@{revision}" if revision else repo_id
        raise SourceError(
            f"{at} is not in the Hugging Face cache and the Hub is unreachable or HF_HUB_OFFLINE is set",
            "download it first (`hf download REPO`), unset HF_HUB_OFFLINE, or point HF_HOME at the cache",
        ) from e
    from fnmatch import fnmatch

    from reshard.sources.hubsmall import check_cached
    from reshard.sources.integrity import CACHE, CACHE_GIT, cache_expected, mismatch
    from reshard.sources.local import weight_files

    root = Path(folder)  # offline: each file checked against the hash its blob is named by
    check_cache_links(root, weight_files(root), repo_id)
    in_git = check_cached(
        root, sorted(p.name for p in root.iterdir() if any(fnmatch(p.name, x) for x in HUB_PATTERNS)), repo_id
    )
    ref = {"repo_id": repo_id, "revision": revision or "main", "commit": root.name}
    expected = cache_expected(root, weight_files(root))
    expected.update({f: (in_git[f], CACHE_GIT) for f in weight_files(root) if f in in_git})

    def fix(name: str, got: str, want: str) -> None:
        raise mismatch(
            f"{repo_id}/{name}@{root.name[:12]} in the Hugging Face cache",
            got,
            want,
            CACHE,
            "the cached copy is corrupt: run with the Hub reachable (HF_HUB_OFFLINE unset) and reshard fetches "
            f"it again, or `hf download {repo_id} {name} --revision {root.name} --force-download`",
        )

    return LocalSource(root, ref, expected, fix=fix)


def check_cache_links(root: Path, files: list[str], repo_id: str) -> None:
    """Offline, each weight of the snapshot `root` that is a link leads to one of the repo's blobs: one that
    leads elsewhere cannot be checked against the sha256 a blob is named by (exit 4, as for side files)."""
    blobs = os.path.normpath(root.parent.parent / "blobs")
    for name in files:
        path = root / name
        if path.is_symlink():
            target = os.path.normpath(os.path.join(path.parent, os.readlink(path)))
            if os.path.dirname(target) != blobs:
                raise SourceError(
                    f"{repo_id}/{name} in the Hugging Face cache links to {target}, outside the repo's blobs: "
                    "reshard cannot check it against the commit's sha256 offline",
                    f"run with the Hub reachable (HF_HUB_OFFLINE unset): reshard fetches it again, or delete {path} "
                    "and download it again",
                )


_CHUNK = 16 * 1024 * 1024  # bytes per request when fetching a cached file again


def refetch(repo, root: Path, name: str, got: str, want: str, why: str | None = None) -> None:
    """Online, `name` of the complete cached snapshot `root` hashed to `got`, not the commit's `want`
    (`why`: what else is wrong with it, said instead, e.g. its size):
    fetch it again (RESHARD_HUB_CONNECTIONS ranges at once) into a file of its own beside its blob,
    hashing as it arrives, and rename that over the blob once it hashes to `want` (fsynced first).
    One line on stderr says so. Exit 4 if the Hub's bytes do not hash to `want` either (the cached
    copy is left as it was)."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    from reshard import settings
    from reshard.scratch import owner, sweep
    from reshard.sources.integrity import HUB, is_sha256, mismatch
    from reshard.sources.prefixhash import PrefixHasher

    # snapshots/<commit>/<name> -> ../../blobs/<sha256>: the blob the commit's sha256 names is written, and the
    # link pointed at it; whatever the link pointed at before (another blob, a file outside the cache) is left
    link = root / name
    where = f"{repo.repo_id}/{name}@{repo.commit[:12]}"
    if not is_sha256(want):
        raise SourceError(f"{where}: the Hub names no sha256 for it, so its cached copy cannot be fetched again")
    blob = root.parent.parent / "blobs" / want
    sweep(blob.parent, "*.reshard-refetch")  # what killed runs left (reshard.scratch)
    sweep(link.parent, ".*.reshard-link")
    tmp = blob.with_name(f"{blob.name}.{owner()}.{uuid.uuid4().hex[:8]}.reshard-refetch")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            head = memoryview(bytearray(8))
            size = repo.fetch(name, 0, head).size
            hasher = PrefixHasher(size, where)

            def one(pos: int) -> None:
                buf = memoryview(bytearray(min(_CHUNK, size - pos)))
                repo.fetch(name, pos, buf)
                done = 0
                while done < len(buf):
                    done += os.pwrite(fd, buf[done:], pos + done)
                hasher.feed(pos, buf)

            with ThreadPoolExecutor(settings.HUB_CONNECTIONS.get()) as pool:
                list(pool.map(one, range(0, size, _CHUNK)))
            digest = hasher.rest(lambda pos, buf: os.preadv(fd, [buf], pos))
            if digest != want:
                raise mismatch(where, digest, want, HUB, "the Hub served other bytes too; run again later")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, blob)
        relinked = link.with_name(f".{link.name}.{owner()}.{uuid.uuid4().hex[:8]}.reshard-link")
        os.symlink(os.path.relpath(blob, link.parent), relinked)
        os.replace(relinked, link)  # the link itself replaced, never followed
    except OSError as e:
        raise SourceError(
            f"cannot write the Hugging Face cache while fetching {where} again (its cached copy is corrupt): {e}",
            f"set HF_HOME to a cache you can write, or delete {blob}",
        ) from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    why = why or f"sha256 {got[:12]}…, the commit's is {want[:12]}…"
    log_line(f"reshard: the cached copy of {where} was corrupt ({why}); fetched it again from the Hub and checked it")
