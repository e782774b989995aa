"""Where checkpoints come from: a local folder, a Hub repo, or an earlier reshard output.

Each is a `Source` (`reshard.checkpoint`): its metadata as a plain `Checkpoint` (config.json and the
safetensors headers; no tensor byte read, no torch imported) and `open_reader()` for the bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.checkpoint import Source
from reshard.errors import SourceError, UsageError
from reshard.names import MANIFEST
from reshard.sources.bucket_output import BucketOutputSource
from reshard.sources.hub import is_repo_id, open_hub
from reshard.sources.local import LocalSource, read_config
from reshard.sources.output import OutputSource
from reshard.store import is_bucket_url, parse_bucket_url

__all__ = ["LocalSource", "OutputSource", "Source", "check_readable", "is_repo_id", "open_source", "read_config"]


def check_readable(folder: Path) -> None:
    """A source folder this user may not list or enter: exit 4 saying so, before a read of it fails as an
    internal error (PermissionError)."""
    if not os.access(folder, os.R_OK | os.X_OK):
        raise SourceError(f"{folder}: cannot read the folder (permission denied)", "make it readable by this user")


def open_source(
    spec: str,
    revision: str | None = None,
    *,
    headers_only: bool = False,
    stream: bool = False,
    sha256_file: Path | None = None,
) -> Source:
    """Resolve SOURCE and read its metadata.

    Args:
        spec: a local folder (a Hugging Face checkpoint, or a reshard output: its `reshard.json`
            says so), a reshard output in a bucket (`s3://bucket/prefix/`), or a Hub repo id (resolved through huggingface_hub's cache, which honours
            HF_HOME and HF_HUB_OFFLINE).
        revision: Hub branch, tag or commit.
        headers_only: for a repo id, fetch config.json and the safetensors headers without
            downloading weights (`reshard plan`); the source then has no reader.
        stream: for a repo id, store nothing of the source: its bytes go from the network into
            the output (default: they are also kept in the cache, once).
        sha256_file: for a local folder, a `sha256sum` file its safetensors files are checked
            against before they are read (`save --source-sha256`).
    """
    if is_bucket_url(spec):
        if revision or sha256_file is not None or stream:
            flag = "--revision" if revision else "--stream" if stream else "--source-sha256"
            raise UsageError(f"{flag} does not apply to {spec}, a reshard output in a bucket", f"drop {flag}")
        return BucketOutputSource(parse_bucket_url(spec))
    path = Path(spec)
    if path.is_dir():
        if revision or stream:  # options of a repo id: asked of a folder, they would do nothing
            flag = "--revision" if revision else "--stream"
            raise UsageError(f"{flag} applies to Hub repo ids, but {spec} is a local folder", f"drop {flag}")
        check_readable(path)
        if (path / MANIFEST).is_file():
            if sha256_file is not None:
                raise UsageError(
                    f"--source-sha256 applies to checkpoint folders; {spec} is a reshard output",
                    "drop it: an output is checked against its own manifest",
                )
            return OutputSource(path)
        return LocalSource(path, {"path": str(path.resolve())}, sha256_file=sha256_file)
    if path.exists():
        raise SourceError(f"{spec} is a file; SOURCE must be a checkpoint folder or a Hub repo id")
    if not is_repo_id(spec) or _looks_local(path):
        raise SourceError(
            f"{spec}: no such folder" + ("" if _looks_local(path) else ", and not a Hub repo id"),
            "give a checkpoint folder or a repo id like Qwen/Qwen3-8B",
        )
    if sha256_file is not None:
        raise UsageError(
            f"--source-sha256 applies to local folders; {spec} is a Hub repo id",
            "drop it: a Hub repo's files are checked against the LFS sha256 the Hub commits to",
        )
    return open_hub(spec, revision, headers_only=headers_only, stream=stream)


def _looks_local(path: Path) -> bool:
    """A path meant as a folder: absolute, ./ or ~ style, or under a folder that exists here."""
    text = str(path)
    return text.startswith(("/", ".", "~")) or (str(path.parent) not in ("", ".") and path.parent.is_dir())
