"""A Hub repo's small files (config.json, the tokenizer, ...) at the pinned commit, into huggingface_hub's
cache layout: `blobs/<id>`, linked from `snapshots/<commit>/<name>`.

Fetched by reshard's own requests (reshard.sources.hubhttp: RESHARD_HUB_TIMEOUT, RESHARD_HUB_RETRIES, one
`reshard: retrying` line a retry, every answer of the pinned commit), not by huggingface_hub's download,
whose own retries took minutes, waited out any Retry-After and filled stderr. Each file is checked
against the commit's hash of it, as the weights are: its LFS sha256, else its git blob sha1 (the model
info's `blobId`): a config.json served edited (another `rope_theta`) is exit 4, not copied into every
output. A cached copy that does not match is fetched again; the blob is written to a file of its own and
renamed, and the link replaced, never written through. Offline (`check_cached`), a cached copy that does not
hash to its blob's name is exit 4.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import uuid
from pathlib import Path

from reshard.errors import SourceError
from reshard.scratch import owner, sweep
from reshard.sources.hubhttp import HubRepo, hub_error, with_retries
from reshard.sources.integrity import is_sha256

_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's bytes (what the Hub calls its blob id, and its ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def expected(lfs: str | None, blob_id: str | None) -> tuple[str, str] | None:
    """(the blob's name in the cache, how its bytes are checked) for a file the commit hashes so."""
    if is_sha256(lfs):
        return lfs, "sha256"
    if blob_id and _GIT_SHA1.fullmatch(blob_id):
        return blob_id, "git"
    return None


_WHAT = {"sha256": "LFS sha256", "git": "git blob sha1"}


def _hash(data: bytes, how: str) -> str:
    return hashlib.sha256(data).hexdigest() if how == "sha256" else git_blob_sha1(data)


def matches(data: bytes, want: tuple[str, str]) -> bool:
    return _hash(data, want[1]) == want[0]


def cached(storage: Path, commit: str, name: str, want: tuple[str, str] | None) -> Path | None:
    """The snapshot's copy of `name`, where it holds the commit's bytes (unchecked where the Hub gave no hash)."""
    path = storage / "snapshots" / commit / name
    if not path.is_file():
        return None
    if want is None:
        return path
    try:
        return path if matches(path.read_bytes(), want) else None
    except OSError:
        return None


def store(storage: Path, commit: str, name: str, data: bytes, want: tuple[str, str] | None) -> Path:
    """`data` as the blob and `name`'s snapshot link (both replaced whole, never written through)."""
    blob_name = want[0] if want else hashlib.sha256(data).hexdigest()
    blobs = storage / "blobs"
    link = storage / "snapshots" / commit / name
    blobs.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{owner()}.{uuid.uuid4().hex[:8]}"
    sweep(blobs, "*.reshard-fetch")  # what killed runs left (reshard.scratch)
    sweep(link.parent, ".*.reshard-link")
    tmp = blobs / f"{blob_name}.{tag}.reshard-fetch"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, blobs / blob_name)
    finally:
        if tmp.exists():
            tmp.unlink()
    relinked = link.with_name(f".{link.name}.{tag}.reshard-link")
    os.symlink(os.path.relpath(blobs / blob_name, link.parent), relinked)
    os.replace(relinked, link)
    return link


def mismatch(repo_id: str, commit: str, name: str, data: bytes, want: tuple[str, str]) -> SourceError:
    return SourceError(
        f"{repo_id}/{name}@{commit[:12]}: the Hub served bytes whose {_WHAT[want[1]]} is {_hash(data, want[1])[:12]}…, "
        "the commit's is "
        f"{want[0][:12]}… (nothing was published)",
        "the Hub, or a proxy or CDN before it, served another file: run again later, or check HF_ENDPOINT",
    )


def check_cached(root: Path, names: list[str], repo_id: str) -> dict[str, str]:
    """Offline: each file `names` of the cache snapshot `root` that links to a blob named by a hash of it
    (huggingface_hub names a blob by the git blob sha1 of a file stored in git, by the LFS sha256 of
    one in LFS; other tools trust that name) hashes to that name; exit 4 where one does not. LFS
    safetensors files are left to the save, which hashes them as it reads them. The sha256 of each file
    checked against a git blob sha1 (what the manifest records of a weight file)."""
    out: dict[str, str] = {}
    blobs = os.path.normpath(root.parent.parent / "blobs")
    for name in names:
        path = root / name
        try:
            target = os.path.normpath(os.path.join(root, os.readlink(path)))
            blob = os.path.basename(target)
            want = expected(blob, blob)
            if want is None or (want[1] == "sha256" and name.endswith(".safetensors")):
                continue
            # a regular file among the repo's blobs only: the save says what is wrong with any other
            if os.path.dirname(target) != blobs or not stat.S_ISREG(os.lstat(target).st_mode):
                continue
            data = Path(target).read_bytes()
        except OSError:  # not a link (nothing names its hash), or unreadable: the save tells
            continue
        if not matches(data, want):
            raise SourceError(
                f"{repo_id}/{name}@{root.name[:12]} in the Hugging Face cache: its {_WHAT[want[1]]} is "
                f"{_hash(data, want[1])[:12]}…, not the {blob[:12]}… its blob is named by: the cached copy is corrupt",
                "run with the Hub reachable (HF_HUB_OFFLINE unset) and reshard fetches it again, or "
                f"`hf download {repo_id} {name} --revision {root.name} --force-download`",
            )
        if want[1] == "git":
            out[name] = hashlib.sha256(data).hexdigest()
    return out


def download(repo: HubRepo, name: str) -> str:
    """`name` of `repo` at its pinned commit, checked, in huggingface_hub's cache; its local path."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo.repo_id, repo_type="model")
    want = expected(repo.lfs.get(name), repo.blob_ids.get(name))
    path = cached(storage, repo.commit, name, want)
    if path is not None:
        return str(path)
    size = repo.sizes.get(name)
    if size is None:  # a Hub that gives no sizes: huggingface_hub's download, checked the same
        return _hf_download(repo, name, want)
    data = bytearray(size)
    if size:
        repo.fetch(name, 0, memoryview(data))
    if want is not None and not matches(bytes(data), want):
        raise mismatch(repo.repo_id, repo.commit, name, bytes(data), want)
    try:
        return str(store(storage, repo.commit, name, bytes(data), want))
    except OSError as e:
        raise SourceError(f"cannot write the Hugging Face cache: {e}", "set HF_HOME to a cache you can write") from e


def _hf_download(repo: HubRepo, name: str, want: tuple[str, str] | None) -> str:
    import huggingface_hub as hub

    try:
        path = with_retries(
            lambda: hub.hf_hub_download(repo.repo_id, name, revision=repo.commit), f"{repo.repo_id}/{name}"
        )
    except SourceError:
        raise
    except Exception as e:
        raise hub_error(repo.repo_id, e, name) from e
    data = Path(path).read_bytes()
    if want is not None and not matches(data, want):
        raise mismatch(repo.repo_id, repo.commit, name, data, want)
    return path
