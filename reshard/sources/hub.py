"""A Hub repo id: resolved through huggingface_hub's cache, or (for `plan`) its metadata alone."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from reshard.checkpoint import Checkpoint, Reader
from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.layout import CONFIG, HUB_PATTERNS
from reshard.sources.local import LocalSource
from reshard.sources.validate import check_config

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not os.path.exists(spec)


class HubMetadataSource:
    """Config and headers fetched from the Hub (range requests), no weights: plannable, not readable."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def open_reader(self) -> Reader:
        raise SourceError(
            f"{self._checkpoint.ref.get('repo_id')}: only its metadata was fetched",
            "save downloads the weights; plan does not",
        )


def open_hub(repo_id: str, revision: str | None, *, headers_only: bool) -> LocalSource | HubMetadataSource:
    import huggingface_hub as hub
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import errors as hub_errors

    offline = hub_constants.HF_HUB_OFFLINE
    patterns = list(HUB_PATTERNS)
    try:
        if headers_only:
            try:
                folder = hub.snapshot_download(
                    repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
                )
                return LocalSource(Path(folder), _hub_ref(repo_id, revision, folder))
            except (hub_errors.LocalEntryNotFoundError, SourceError):
                if offline:
                    raise
            return HubMetadataSource(_hub_metadata(repo_id, revision))
        folder = hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=offline)
    except hub_errors.LocalEntryNotFoundError as e:
        raise SourceError(
            f"{repo_id}{'@' + revision if revision else ''} is not in the Hugging Face cache and the Hub is unreachable or HF_HUB_OFFLINE is set",
            "download it first (`hf download REPO`), unset HF_HUB_OFFLINE, or point HF_HOME at the cache",
        ) from e
    except (hub_errors.RepositoryNotFoundError, hub_errors.GatedRepoError) as e:
        raise SourceError(
            f"{repo_id}: repository not found or not accessible", "check the name and your HF token"
        ) from e
    except hub_errors.RevisionNotFoundError as e:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from e
    return LocalSource(Path(folder), _hub_ref(repo_id, revision, folder))


def _hub_ref(repo_id: str, revision: str | None, folder: str | os.PathLike) -> dict:
    # snapshot folders are named after the commit hash
    return {"repo_id": repo_id, "revision": revision or "main", "commit": Path(folder).name}


def _hub_metadata(repo_id: str, revision: str | None) -> Checkpoint:
    """Config and headers from the Hub without weights (range requests for the headers)."""
    import huggingface_hub as hub

    try:
        info = hub.model_info(repo_id, revision=revision)
        cfg_path = hub.hf_hub_download(repo_id, CONFIG, revision=info.sha)
        with open(cfg_path) as f:
            config = check_config(json.load(f), repo_id)
        meta = hub.get_safetensors_metadata(repo_id, revision=info.sha)
    except SourceError:
        raise
    except Exception as e:  # network, auth, not a safetensors repo: all user-facing
        raise SourceError(f"{repo_id}: cannot read metadata from the Hub ({e})") from e
    tensors: dict[str, TensorInfo] = {}
    files = []
    for fname, fmeta in meta.files_metadata.items():
        files.append(fname)
        for key, t in fmeta.tensors.items():
            begin, end = t.data_offsets
            tensors[key] = TensorInfo(key, t.dtype, tuple(t.shape), fname, begin, end - begin)
    ref = {"repo_id": repo_id, "revision": revision or "main", "commit": info.sha}
    return Checkpoint(None, config, tensors, files, ref)
