"""Find a checkpoint (local folder or Hub repo id) and read its config and safetensors headers.

Reads metadata only: config.json, the index and the headers. No tensor byte is read here, and
torch is not imported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import SourceError
from reshard.format import TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MANIFEST = "reshard.json"

# Files a Hub download needs: weights, config, tokenizer and generation files.
HUB_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "tokenizer*",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Checkpoint:
    """A source checkpoint's metadata.

    Attributes:
        root: local folder holding the files; None when only Hub metadata was fetched (`plan`).
        config: parsed config.json.
        tensors: every tensor by name, from the headers.
        files: safetensors file names, in index order.
        ref: where it came from: {"path": ...} or {"repo_id", "revision", "commit"}.
        file_sizes: size of each safetensors file in bytes.
    """

    root: Path | None
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    ref: dict
    file_sizes: dict[str, int] = field(default_factory=dict)
    # set when SOURCE is a reshard output: how to read tensors back out of its rank files
    reader_factory: Callable[[], object] | None = None
    manifest: dict | None = None
    missing: list[str] = field(default_factory=list)  # source tensors the output does not hold

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not os.path.exists(spec)


def open_checkpoint(spec: str, revision: str | None = None, *, headers_only: bool = False) -> Checkpoint:
    """Resolve SOURCE and read its metadata.

    Args:
        spec: a local folder, or a Hub repo id (resolved through huggingface_hub's cache, which
            honours HF_HOME and HF_HUB_OFFLINE).
        revision: Hub branch, tag or commit.
        headers_only: for a repo id, fetch config.json and the safetensors headers without
            downloading weights (used by `reshard plan`).
    """
    path = Path(spec)
    if path.is_dir():
        if revision:
            raise SourceError(f"--revision applies to Hub repo ids, but {spec} is a local folder")
        if (path / MANIFEST).is_file():
            from reshard.inverse import open_output

            return open_output(path)
        return _open_local(path, {"path": str(path.resolve())})
    if path.exists():
        raise SourceError(f"{spec} is a file; SOURCE must be a checkpoint folder or a Hub repo id")
    if not is_repo_id(spec):
        raise SourceError(
            f"{spec}: no such folder, and not a Hub repo id",
            "give a checkpoint folder or a repo id like Qwen/Qwen3-8B",
        )
    return _open_hub(spec, revision, headers_only=headers_only)


def _open_local(root: Path, ref: dict) -> Checkpoint:
    config = read_config(root)
    files = _weight_files(root)
    tensors: dict[str, TensorInfo] = {}
    sizes: dict[str, int] = {}
    for name in files:
        found, _, size = read_header(root / name)
        sizes[name] = size
        for key, info in found.items():
            if key in tensors:
                raise SourceError(f"{root}: tensor {key!r} appears in {tensors[key].file} and {name}")
            tensors[key] = info
    return Checkpoint(root, config, tensors, files, ref, sizes)


def read_config(root: Path) -> dict:
    try:
        with open(root / "config.json") as f:
            return json.load(f)
    except FileNotFoundError:
        raise SourceError(f"{root}: no config.json", "SOURCE must be a Hugging Face checkpoint folder") from None
    except (OSError, ValueError) as e:
        raise SourceError(f"{root / 'config.json'}: cannot parse ({e})") from e


def _weight_files(root: Path) -> list[str]:
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise SourceError(f"{index}: cannot parse ({e})") from e
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise SourceError(
                f"{root}: {len(missing)} shard(s) named in {INDEX} are missing: {', '.join(missing[:3])}",
                "download the checkpoint again (e.g. `hf download REPO`)",
            )
        return files
    if (root / SINGLE).is_file():
        return [SINGLE]
    found = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not found:
        hint = "reshard reads safetensors only; convert .bin checkpoints first"
        raise SourceError(f"{root}: no *.safetensors weights found", hint)
    return found


def _open_hub(repo_id: str, revision: str | None, *, headers_only: bool) -> Checkpoint:
    import huggingface_hub as hub
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import errors as hub_errors

    offline = hub_constants.HF_HUB_OFFLINE
    try:
        if headers_only:
            try:
                folder = hub.snapshot_download(
                    repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True
                )
                return _open_local(Path(folder), _hub_ref(repo_id, revision, folder))
            except (hub_errors.LocalEntryNotFoundError, SourceError):
                if offline:
                    raise
            return _hub_metadata(repo_id, revision)
        folder = hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline
        )
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
    return _open_local(Path(folder), _hub_ref(repo_id, revision, folder))


def _hub_ref(repo_id: str, revision: str | None, folder: str | os.PathLike) -> dict:
    # snapshot folders are named after the commit hash
    return {"repo_id": repo_id, "revision": revision or "main", "commit": Path(folder).name}


def _hub_metadata(repo_id: str, revision: str | None) -> Checkpoint:
    """Config and headers from the Hub without weights (range requests for the headers)."""
    import huggingface_hub as hub

    try:
        info = hub.model_info(repo_id, revision=revision)
        cfg_path = hub.hf_hub_download(repo_id, "config.json", revision=info.sha)
        with open(cfg_path) as f:
            config = json.load(f)
        meta = hub.get_safetensors_metadata(repo_id, revision=info.sha)
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
