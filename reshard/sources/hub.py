"""A Hub repo id: read from the Hub as the save consumes it, or from huggingface_hub's cache.

- HF_HUB_OFFLINE: the cache only (`snapshot_download(local_files_only=True)`), as before.
- Online: the revision is pinned to its commit (`reshard.sources.hubhttp.HubRepo`); a snapshot of
  that commit complete in the cache is read as a local folder; otherwise a `HubSource` plans from
  config.json and headers fetched by range, and streams the weights (`reshard.sources.hubsource`):
  cached as it goes (default) or not stored at all (`stream`).
- The Hub unreachable (after retries): the cache, if it has the revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from reshard.errors import SourceError
from reshard.names import CONFIG, HUB_PATTERNS
from reshard.sources.local import LocalSource

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


def _online(repo, *, headers_only: bool, stream: bool):
    from fnmatch import fnmatch

    from reshard.sources.hubsource import HubSource, weight_names

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
        path = Path(repo.download(name))
        root = root or path.parent
    assert root is not None
    files = weight_names(repo, root)
    ref = {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit}
    if all((root / f).is_file() for f in files):  # complete in the cache: a local folder, checked before use
        from reshard.sources.integrity import HUB, cache_expected

        expected = cache_expected(root, files)  # the blob names, unless the commit says otherwise:
        expected.update({f: (repo.lfs[f], HUB) for f in files if f in repo.lfs})
        return LocalSource(root, ref, expected)
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
    from reshard.sources.integrity import cache_expected
    from reshard.sources.local import weight_files

    root = Path(folder)  # offline: each file checked against the sha256 its blob is named by
    ref = {"repo_id": repo_id, "revision": revision or "main", "commit": root.name}
    return LocalSource(root, ref, cache_expected(root, weight_files(root)))
