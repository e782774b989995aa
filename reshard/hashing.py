"""The one place that knows how reshard checksums files: the algorithm, and hashing a file fast."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

ALGORITHM = "sha256"  # what the manifest's per-file `sha256` holds
READ_BLOCK = 16 * 1024 * 1024


def new_hasher(algorithm: str = ALGORITHM):
    """An incremental hasher (`update`, `hexdigest`); hashlib releases the GIL on large updates."""
    if algorithm != "sha256":
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    return hashlib.sha256()


def manifest_algorithm(manifest: dict) -> str:
    """The checksum algorithm of a manifest's file digests: its `checksum` field when it records one
    ("none": files were written without checksums); absent -> sha256, the only one before it was
    recorded."""
    algo = manifest.get("checksum")
    return algo if isinstance(algo, str) and algo else ALGORITHM


def recorded_digest(entry: dict, algorithm: str) -> str | None:
    """A manifest file entry's digest in `algorithm` (None when it records none)."""
    if algorithm == "none":
        return None
    digest = entry.get("digest", entry.get(algorithm))
    return digest if isinstance(digest, str) else None


def hash_bytes(data: bytes | memoryview, algorithm: str = ALGORITHM) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def hash_file(
    path: Path,
    algorithm: str = ALGORITHM,
    *,
    advance: Callable[[int], None] | None = None,
    block: int = READ_BLOCK,
) -> str:
    """A file's checksum: large sequential reads into one reused buffer. Raises OSError."""
    h = new_hasher(algorithm)
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if advance is not None:
                advance(n)
    return h.hexdigest()
