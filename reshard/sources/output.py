"""A reshard output folder read as the checkpoint it was made from.

The manifest records the source's tensor names, dtypes and shapes; planning the recorded layout
again tells, for every piece of every output tensor, which region of which source tensor it holds.
From those regions any row range of a source tensor can be read back out of the rank files (KV
replicas and replicated tensors are read once; up-sampled FP8 scales are taken back down). This
serves `save` with an output as SOURCE (re-shard without the original) and `merge` (back to HF).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.checkpoint import Checkpoint, Reader
from reshard.errors import CorruptError, SourceError
from reshard.format import ITEMSIZE, TensorInfo, read_header
from reshard.hashing import hash_file
from reshard.manifest import read_manifest
from reshard.plan import Slice, build_plan
from reshard.sources.local import read_config

VIRTUAL = "<reshard-output>"


@dataclass(frozen=True, slots=True)
class Region:
    """Part of a source tensor stored contiguously (row-major) in one output file."""

    file: str
    offset: int  # absolute byte offset in the file
    start: tuple[int, ...]  # in the (possibly up-sampled) source coordinates
    stop: tuple[int, ...]
    up: tuple[int, ...] | None
    pad: tuple[int, ...] | None = None  # stored padded to this extent (plan.model.Slice.pad)


class OutputSource:
    """An output folder (checked whole against its manifest first) whose tensors are read back out of
    its rank files."""

    def __init__(self, path: Path, *, checksums: bool = True) -> None:
        self.path = path
        self._checkpoint, self.regions = read_output(path, checksums=checksums)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def open_reader(self) -> Reader:
        return OutputReader(self.path, self.regions)


def read_output(path: Path, *, checksums: bool = True) -> tuple[Checkpoint, dict[str, list[Region]]]:
    """The original checkpoint's metadata, and where each of its tensors lies in the rank files."""
    manifest = read_manifest(path)
    if checksums:
        check_files(path, manifest)
    config = read_config(path)
    # --dtype auto on a re-shard means the dtype the output holds, not the original's
    config = {**config, "torch_dtype": manifest["layout"]["dtype"]}
    layout = manifest["layout"]
    original = {
        n: TensorInfo(n, d, tuple(s), VIRTUAL, 0, math.prod(s) * ITEMSIZE[d])
        for n, (d, s) in manifest["source_tensors"].items()
    }
    old = build_plan(
        Checkpoint(None, config, original, [VIRTUAL], manifest["source"]),
        tp=layout["tp"],
        pp=layout["pp"],
        ep=layout["ep"],
        dtype=layout["dtype"],
        pp_partition=layout.get("pp_layer_partition"),
        moe_backend=layout.get("moe_backend") or "auto",
    )
    regions: dict[str, list[Region]] = {}
    dtypes: dict[str, str] = {}
    for f in old.files:
        header, _, _ = read_header(path / f.name)
        for t in f.tensors:
            if t.name not in header:
                raise CorruptError(f"{path / f.name}: tensor {t.name} is missing", "the output is damaged")
            pos = header[t.name].offset
            for p in t.pieces:
                nbytes = p.numel * ITEMSIZE[t.dtype]
                if isinstance(p, Slice):
                    if dtypes.setdefault(p.source, t.dtype) != t.dtype:
                        raise SourceError(f"{p.source} is stored in two dtypes; cannot read it back")
                    regions.setdefault(p.source, []).append(Region(f.name, pos, p.start, p.stop, p.up, p.pad))
                pos += nbytes
    tensors = {}
    for name, regs in regions.items():
        shape = original[name].shape
        tensors[name] = TensorInfo(name, dtypes[name], shape, VIRTUAL, 0, math.prod(shape) * ITEMSIZE[dtypes[name]])
        regions[name] = _tile(name, shape, regs)
    ref = {"path": str(path.resolve()), "resharded_from": manifest["source"], "from_run": manifest["run_id"]}
    ckpt = Checkpoint(path, config, tensors, [], ref, manifest=manifest, missing=sorted(set(original) - set(tensors)))
    return ckpt, regions


def _tile(name: str, shape: tuple[int, ...], regs: list[Region]) -> list[Region]:
    """Drop replicas so the regions cover the tensor once; check they cover all of it."""
    seen: dict[tuple, Region] = {}
    for r in regs:
        seen.setdefault((r.start, r.stop, r.up), r)
    unique = list(seen.values())
    if any(r.up for r in unique):
        return unique  # small scale tensors: painted whole, overlaps are copies of one value
    covered = sum(math.prod(b - a for a, b in zip(r.start, r.stop, strict=True)) for r in unique)
    if covered != math.prod(shape):
        raise SourceError(f"{name}: the output's pieces do not cover it exactly; cannot read it back")
    return unique


class OutputReader:
    """A `Reader` over an output folder's regions: a source tensor's rows, gathered from the rank files."""

    def __init__(self, root: Path, regions: dict[str, list[Region]]) -> None:
        self.root = root
        self.regions = regions
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

    def _pread(self, file: str, offset: int, nbytes: int) -> bytes:
        if file not in self.fds:
            self.fds[file] = os.open(self.root / file, os.O_RDONLY)
        data = os.pread(self.fds[file], nbytes, offset)
        if len(data) != nbytes:
            raise CorruptError(f"{self.root / file}: truncated", "the output is damaged")
        self.bytes_read += nbytes
        return data

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        shape = t.shape if t.shape else (1,)
        item = ITEMSIZE[t.dtype]
        row_bytes = t.nbytes // shape[0]
        r0, r1 = start // row_bytes, (start + nbytes) // row_bytes
        out = np.empty((r1 - r0, *shape[1:], item), np.uint8)
        regs = self.regions[t.name]
        if any(r.up for r in regs):
            whole = self._paint(t, shape, item, regs)
            out[...] = whole[r0:r1]
        else:
            for r in regs:
                a, b = (r.start, r.stop) if r.start else ((0,), (1,))
                lo, hi = max(a[0], r0), min(b[0], r1)
                if hi <= lo:
                    continue
                inner = tuple(y - x for x, y in zip(a[1:], b[1:], strict=True))
                stored = r.pad[1:] if r.pad else inner  # a padded region: its rows are wider in the file
                rb = math.prod(stored) * item
                data = self._pread(r.file, r.offset + (lo - a[0]) * rb, (hi - lo) * rb)
                block = np.frombuffer(data, np.uint8).reshape((hi - lo, *stored, item))
                block = block[(slice(None), *(slice(0, n) for n in inner))]
                idx = (slice(lo - r0, hi - r0), *(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                out[idx] = block
        view = memoryview(out).cast("B")
        if buf is not None:
            memoryview(buf)[:nbytes] = view
            return memoryview(buf)[:nbytes]
        return view

    def _paint(self, t: TensorInfo, shape: tuple[int, ...], item: int, regs: list[Region]) -> np.ndarray:
        whole = np.zeros((*shape, item), np.uint8)
        for r in regs:
            assert r.pad is None, "up-sampled pieces are never padded"
            up = r.up or (1,) * len(shape)
            dims = [b - a for a, b in zip(r.start, r.stop, strict=True)]
            data = self._pread(r.file, r.offset, math.prod(dims) * item)
            block = np.frombuffer(data, np.uint8).reshape((*dims, item))
            index = np.ix_(*[np.arange(a, b) // k for a, b, k in zip(r.start, r.stop, up, strict=True)])
            whole[index] = block
        return whole

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def check_files(path: Path, manifest: dict) -> None:
    """Refuse an output as SOURCE unless every file is present, whole and unaltered."""

    def check(entry: dict) -> str | None:
        p = path / entry["name"]
        try:
            if p.stat().st_size != entry["size"]:
                return f"{entry['name']} has {p.stat().st_size} bytes, the manifest says {entry['size']}"
            digest = hash_file(p)
        except OSError as e:
            return f"{entry['name']}: {e.strerror}"
        return None if digest == entry["sha256"] else f"{entry['name']} fails its sha256 checksum"

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for p in pool.map(check, manifest["files"]) if p]
    if problems:
        raise CorruptError(
            f"{path} cannot be used as SOURCE: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            "run `reshard verify` on it, or reshard the original checkpoint",
        )
