"""The safetensors file format, read and written by hand (no torch).

A file is: 8-byte little-endian header length N, N bytes of JSON (padded with spaces to a multiple
of 8), then the tensor bytes back to back. Each JSON entry gives dtype, shape and
`data_offsets` [begin, end) relative to the start of the data section.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import BinaryIO, NamedTuple

from reshard.errors import SourceError
from reshard.fastheader import parse_compact

# safetensors dtype code -> bytes per element
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# user-facing names (torch's) <-> safetensors codes
DTYPE_NAMES: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
DTYPE_CODES: dict[str, str] = {v: k for k, v in DTYPE_NAMES.items()}

# A header larger than this is treated as corrupt (real ones are a few MB at most).
MAX_HEADER = 256 * 1024 * 1024


class TensorInfo(NamedTuple):
    """One tensor of a safetensors file, as its header describes it.

    A named tuple, not a frozen dataclass: one is made per source tensor (200k to 1M headers, issue 28),
    and a dataclass's field-by-field __init__ cost 3x the tuple's (0.44 against 0.15 s per 200k)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name, relative to the checkpoint folder
    offset: int  # absolute byte offset of the first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def records(tensors: Mapping[str, tuple[str, tuple[int, ...]]], file: str) -> dict[str, TensorInfo]:
    """name -> (dtype, shape) (a manifest's source tensors) as records of `file` at offset 0: tensors
    known by name, dtype and shape alone. One size per distinct (dtype, shape), each record made without a
    `__new__` call (197,763 of them for a large MoE's output read back: 0.17 -> 0.11 s)."""
    sizes: dict[tuple[str, tuple[int, ...]], int] = {}
    out = {}
    for name, kind in tensors.items():
        nbytes = sizes.get(kind)
        if nbytes is None:
            nbytes = sizes[kind] = math.prod(kind[1]) * ITEMSIZE[kind[0]]
        out[name] = _new(TensorInfo, (name, kind[0], kind[1], file, 0, nbytes))
    return out


def read_header(
    path: Path, *, size: int | None = None, follow: bool = True
) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate a safetensors header.

    Returns (tensors by name, `__metadata__`, size of the file). Raises SourceError naming the file
    on any inconsistency: truncation, a length field larger than the file, bad JSON, unknown dtypes,
    offsets outside the file, holes or overlaps; or a path that is not a regular file (a FIFO is
    never waited on).

    size: check the offsets against this size instead of the file's (`verify` reads the header of
        a truncated file as the size it was written with, to tell which tensors the cut hits).
    follow: False for a file a manifest names (a symlink is refused, not followed).
    """
    raw, size = read_raw_header(path, size=size, follow=follow)
    return parse_header(raw, size, str(path), path.name)


def read_raw_header(path: Path, *, size: int | None = None, follow: bool = True) -> tuple[bytes, int]:
    """`read_header`'s reading half: the header's JSON bytes, unparsed, and the size of the file (or
    `size`); the same SourceErrors for a file that cannot hold the header it announces."""
    try:
        fd = open_regular(path, follow=follow)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size if size is None else size
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{path}: truncated safetensors file ({size} bytes)", _REDOWNLOAD)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER:
                raise SourceError(
                    f"{path}: corrupt safetensors header (header length {n} but file has {size} bytes)",
                    _REDOWNLOAD,
                )
            raw = f.read(n)
    except OSError as e:
        raise SourceError(
            f"{path}: cannot read ({e.strerror})", "check the file's permissions, or download it again"
        ) from e
    return raw, size


# ---- files named by someone else: regular files only, never followed out, never waited on ------------


class NotRegular(OSError):
    """A path that is a symlink not to be followed, or not a regular file (FIFO, device, socket,
    folder): never read. Its strerror says which."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((what for test, what in _KINDS if test(mode)), "a device or other special file")


def open_regular(path: Path | str, *, follow: bool = True, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file `path`, opened without blocking (a FIFO with no
    writer is refused at once, not waited on); with `follow` False a symlink is refused too.
    `dir_fd`: the folder a relative `path` is in. Raises NotRegular, or the OSError of the open."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotRegular(errno.ELOOP, "a symlink (not followed)", str(path)) from None
        if e.errno == errno.ENXIO:  # a socket
            raise NotRegular(errno.ENXIO, "not a regular file (a socket)", str(path)) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, f"not a regular file ({kind(mode)})", str(path))
    os.set_blocking(fd, True)
    return fd


def read_at_most(f: BinaryIO, limit: int) -> bytes:
    """Up to `limit` + 1 bytes of `f` (one more than allowed: the caller sees it was longer), read in 1 MiB steps:
    `f.read(limit + 1)` reserves the whole limit first (256 MiB for a 700-byte config.json, a MemoryError
    under a `ulimit -v`)."""
    chunks, total = [], 0
    while total <= limit and (b := f.read(min(1 << 20, limit + 1 - total))):
        chunks.append(b)
        total += len(b)
    return b"".join(chunks)


def open_inside(folder: Path, name: str) -> int:
    """`open_regular` of `name` (relative, `/`-separated) inside `folder`, following no symlink on
    the way: each folder of the name is opened without following links. Raises NotRegular for a
    name that leaves the folder or passes a symlink."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        raise NotRegular(errno.EINVAL, "a name outside the folder", name)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotRegular(e.errno, f"{part} is a symlink or not a folder (not followed)", name) from None
                raise
            os.close(dfd)
            dfd = sub
        return open_regular(parts[-1], follow=False, dir_fd=dfd)
    finally:
        os.close(dfd)


def parse_header(
    raw: bytes, size: int, where: str, file_name: str
) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """`read_header` on header bytes `raw` (the JSON after the 8-byte length) of a file of `size`
    bytes named `file_name`; errors name `where` (a path, or a Hub URL).

    Paid in bulk (issue 28: headers of 200k to 1M tensors). A header spelled compactly, as the
    format's writers spell it, is parsed by `reshard.fastheader` with no Python code per tensor. Any
    other: the JSON parser hands each entry spelled as safetensors writes it ({"dtype", "shape",
    "data_offsets"}, in that order) over already checked, as a small tuple whose shape is shared by
    every entry of that dtype and shape (`_Entries`); the offsets are checked for holes and overlaps in
    header order when they run in it, else by following them from 0, never with a sort. Whatever that
    does not accept is checked entry by entry (`_entry`, `_check_spans`), with the same errors."""
    compact = parse_compact(raw, size, file_name, ITEMSIZE, TensorInfo)
    if compact is not None:  # every check below passes for it, with these records
        return compact
    path = where
    n = len(raw)
    start = 8 + n
    try:
        obj = json.loads(raw, object_pairs_hook=_Entries(start, size).hook)
        if type(obj) is tuple:  # a header spelled like one entry: the plain object it is
            obj = _as_object(obj)
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SourceError(f"{path}: corrupt safetensors header ({str(e)[:200]})", _REDOWNLOAD) from e
    meta = obj.pop("__metadata__", None) or {}
    if type(meta) is tuple:  # a __metadata__ spelled like a tensor entry: as the plain object it is
        meta = _as_object(meta)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)", _REDOWNLOAD)
    tensors: dict[str, TensorInfo] = {}
    pos = 0  # where the next tensor begins while they run back to back in header order
    in_order = True  # every entry checked by the hook, back to back from 0 so far (those of no bytes too)
    for name, entry in obj.items():
        if type(entry) is tuple:
            dtype, shape, nbytes, begin = entry
            tensors[name] = _new(TensorInfo, (name, dtype, shape, file_name, start + begin, nbytes))  # no __new__ call
            if in_order:
                in_order = begin == pos
                pos = begin + nbytes
            continue
        in_order = False
        tensors[name] = _entry(path, name, entry, start, size, file_name)
    end = pos if in_order else _check_spans(path, tensors, start)
    if start + end != size:  # the safetensors library (so vLLM) refuses it: "file not fully covered"
        raise SourceError(
            f"{path}: {size - start - end} bytes after its last tensor, which the safetensors library "
            "(and vLLM) refuses",
            _REDOWNLOAD,
        )
    return tensors, {str(k): str(v) for k, v in meta.items()}, size


_new = tuple.__new__


class _Entries:
    """json's object_pairs_hook for one header of a file of `size` bytes whose data starts at `start`:
    an object spelled {"dtype", "shape", "data_offsets"} (in that order) that `_entry` would accept
    becomes (dtype, shape, bytes, begin), its shape tuple shared by every entry of its dtype and
    shape; any other object the dict json makes."""

    def __init__(self, start: int, size: int) -> None:
        self.left = size - start  # bytes of the data section
        self.shapes: dict[tuple, tuple[tuple[int, ...], int]] = {}  # (dtype, *shape, *its types) -> shape, bytes

    def hook(self, pairs: list[tuple[str, object]]) -> object:
        if len(pairs) == 3:
            (k0, dtype), (k1, shape), (k2, offsets) = pairs
            if (
                k0 == "dtype"
                and k1 == "shape"
                and k2 == "data_offsets"
                and type(dtype) is str
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
            ):
                try:  # the key holds each dim's type: no bool or float (1 == True == 1.0 as keys) finds an int's
                    known = self.shapes.get((dtype, *shape, *map(type, shape)))
                except TypeError:  # a dim that is a list or an object
                    return dict(pairs)
                if known is None and dtype in ITEMSIZE and all(type(d) is int and d >= 0 for d in shape):
                    key = (dtype, *shape, *map(type, shape))
                    known = self.shapes[key] = (tuple(shape), math.prod(shape) * ITEMSIZE[dtype])
                begin, end = offsets
                if (
                    known is not None
                    and type(begin) is int
                    and type(end) is int
                    and begin >= 0
                    and end - begin == known[1]
                    and end <= self.left
                ):
                    return (dtype, known[0], known[1], begin)
        return dict(pairs)


def _as_object(entry: tuple) -> dict:
    """The JSON object the hook made an entry tuple of."""
    dtype, shape, nbytes, begin = entry
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + nbytes]}


def _entry(path: str, name: str, entry: object, start: int, size: int, file_name: str) -> TensorInfo:
    """One header entry checked on its own (every shape of entry the format does not write)."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]  # type: ignore[index]
        if not isinstance(dtype, str) or not all(_is_int(x) for x in (*shape, begin, end)):
            raise TypeError("dtype must be a string, shape and data_offsets integers")
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{path}: corrupt header entry for {name!r}", _REDOWNLOAD) from e
    if any(d < 0 for d in shape):
        raise SourceError(f"{path}: tensor {name!r} has a negative dimension {list(shape)}", _REDOWNLOAD)
    if dtype not in ITEMSIZE:
        raise SourceError(
            f"{path}: tensor {name!r} has unsupported dtype {dtype}",
            f"reshard reads the safetensors dtypes ({', '.join(ITEMSIZE)}); convert the checkpoint first",
        )
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if begin < 0:
        raise SourceError(f"{path}: tensor {name!r} starts at a negative offset {begin}", _REDOWNLOAD)
    if end - begin != nbytes:
        raise SourceError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but its shape needs {nbytes}",
            _REDOWNLOAD,
        )
    if start + end > size:
        raise SourceError(
            f"{path}: truncated: tensor {name!r} ends at byte {start + end}, file has {size}",
            _REDOWNLOAD,
        )
    return TensorInfo(name, dtype, shape, file_name, start + begin, nbytes)


def _check_spans(path: str, tensors: dict[str, TensorInfo], start: int) -> int:
    """In offset order each tensor, of no bytes too (the safetensors library's "invalid offset"), begins
    where the one before it ends, from 0 (else it is named); returns where the data ends, from `start`."""
    spans = sorted((t.offset - start, t.offset - start + t.nbytes, name) for name, t in tensors.items())
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SourceError(f"{path}: tensor {name!r} overlaps or leaves a hole", _REDOWNLOAD)
        pos = end
    return pos


_REDOWNLOAD = "the file is damaged or partly downloaded: download it again"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def encode_header(
    entries: list[tuple[str, str, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
    anchor: int = 0,
) -> bytes:
    """Encode a header for tensors laid out back to back in the given order.

    `entries` are (name, dtype code, shape). Returns the 8-byte length plus the JSON padded with
    spaces (as the format allows) so that byte `anchor` of the data section, which follows
    immediately, lies at a multiple of `align` in the file. align 8, anchor 0 is the safetensors
    library's own choice (byte-identical headers); the executor page-aligns the data most of its
    bytes start at, so that they go to disk from the read buffers with O_DIRECT. `anchor` is a
    multiple of 8 (the data section stays 8-aligned).
    """
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    raw += b" " * (-(8 + len(raw) + anchor) % align)
    return struct.pack("<Q", len(raw)) + raw


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
