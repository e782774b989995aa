"""A safetensors header spelled as the format's writers spell it, parsed in bulk (issue 28).

The safetensors library (transformers' and vLLM's writer) and reshard write a header as compact JSON:
`{"__metadata__":{...},"NAME":{"dtype":"BF16","shape":[a,b],"data_offsets":[begin,end]},...}`, the
tensors back to back in header order, padded with spaces. For such a header one regular expression
finds every entry's five fields at once, and every further step is a pass in C over the columns
(`map`, `zip`, `compress`): no Python code runs per tensor. A 98,880-tensor header (11.8 MB) that
json and the per-entry hook of `reshard.format.parse_header` parse in 0.36-0.41 s is parsed here in
0.25-0.28 s (the findall 0.11-0.13 s of it; docs/benchmarks.md).

`parse_compact` accepts only what it can prove is exactly that text, and returns what
`parse_header` would return for it; for anything else (spaces between tokens, an escape in a name,
`__metadata__` not first, entries out of order, a duplicate name, a check that fails) it returns
None and `parse_header` parses the header as before, with its own checks and errors. It never
raises for bad input.

Why the entries found are the whole header: a match begins with `,"`, which never occurs inside a
JSON string (a `"` there is escaped, so preceded by a backslash). The first match starts where the
metadata ends (or at the first entry), and the matches' lengths sum to the span from there to the
byte before the header's closing `}`, which must be the last entry's `}`. Matches cannot overlap, so
a byte left between two of them would push the last match's end past that `}`, onto the header's
own, and leave a `]` where the last entry's `}` was checked to be: they tile the span exactly.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import NamedTuple

_INT = rb"(0|[1-9][0-9]*)"  # a JSON integer >= 0 (no sign, no leading zero)
_ENTRY = re.compile(
    rb',"([^"\\\x00-\x1f]*)":\{"dtype":"([0-9A-Z_a-z]+)","shape":\[([0-9,]*)\],"data_offsets":\['
    + _INT
    + rb","
    + _INT
    + rb"\]\}"
)
_FIXED = len(b',"":{"dtype":"","shape":[],"data_offsets":[,]}')  # an entry's bytes besides its five fields
_DIMS = re.compile(rb"(?:(?:0|[1-9][0-9]*)(?:,(?:0|[1-9][0-9]*))*)?")  # a shape's list, checked once per shape
_END = re.compile(rb"\}\}[ \t\n\r]*")  # the last entry's `}`, the header's, then JSON whitespace
_METADATA = b'{"__metadata__":'
_new = tuple.__new__
_DTYPE, _SHAPE, _NBYTES = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)

Parsed = tuple[dict, dict[str, str], int]


class Columns(NamedTuple):
    """A header's tensors column by column, in header order: what `build` makes the records of, and
    what a process parsing headers for another sends it (reshard.sources.headers)."""

    names: bytes  # UTF-8 (surrogates passed through, as json decodes), joined by NUL (no name holds one)
    kinds: list[tuple[str, tuple[int, ...], int]]  # the distinct (dtype, shape, bytes)
    kind_ids: Sequence[int]  # each tensor's index into `kinds` (a list, or the array a child sent)
    offsets: Sequence[int]  # each tensor's first byte in the file


def parse_compact(
    raw: bytes, size: int, file_name: str, itemsize: Mapping[str, int], record: Callable
) -> Parsed | None:
    """(tensors by name, `__metadata__`, `size`) for header JSON `raw` of a file of `size` bytes, as
    `reshard.format.parse_header` returns them, each tensor a `record` (name, dtype, shape,
    `file_name`, offset in the file, bytes), `itemsize` giving each dtype's bytes per element; None
    where the header is not the compact spelling or any check fails (parse it the general way)."""
    scanned = scan(raw, size, itemsize)
    if scanned is None:
        return None
    tensors = build(scanned[0], file_name, record)
    if tensors is None:
        return None
    return tensors, scanned[1], size


def scan(raw: bytes, size: int, itemsize: Mapping[str, int]) -> tuple[Columns, dict[str, str]] | None:
    """`parse_compact`'s columns and `__metadata__`, before any record is made; None as there. A name
    repeated is found by `build` (json keeps the last: the general parser's case)."""
    try:
        return _scan(raw, size, itemsize)
    except (ValueError, UnicodeDecodeError, RecursionError):  # an int too long for int(), bad JSON
        return None


def build(columns: Columns, file_name: str, record: Callable) -> dict | None:
    """The records of `columns` by name, in header order; None where a name repeats or is
    `__metadata__` (the general parser's cases) or the names are not UTF-8."""
    try:
        text = columns.names.decode("utf-8", "surrogatepass").split("\0")
    except UnicodeDecodeError:
        return None
    kind = list(map(columns.kinds.__getitem__, columns.kind_ids))
    if not len(text) == len(kind) == len(columns.offsets):
        return None
    dtypes, shapes, nbytes = map(_DTYPE, kind), map(_SHAPE, kind), map(_NBYTES, kind)
    fields = zip(text, dtypes, shapes, repeat(file_name), columns.offsets, nbytes)  # the lengths checked above
    tensors = dict(zip(text, map(_new, repeat(record), fields)))  # noqa: B905
    if len(tensors) != len(text) or "__metadata__" in tensors:
        return None
    return tensors


def _scan(raw: bytes, size: int, itemsize: Mapping[str, int]) -> tuple[Columns, dict[str, str]] | None:
    if raw.startswith(_METADATA):
        body = raw
    elif raw.startswith(b'{"'):
        body = b"," + raw[1:]  # the first entry begins like every other
    else:
        return None
    first = _ENTRY.search(body)
    if first is None or first[4] != b"0":  # the first entry must begin the data: else out of order (an
        return None  # older writer's) or damaged, parsed the general way without a scan of every entry
    begin = first.start()
    found = _ENTRY.findall(body, begin)
    names, dtypes, shapes, starts, ends = zip(*found, strict=True)
    n = len(found)
    joined = b"\0".join(names)  # no name holds a NUL (the pattern refuses control characters)
    counts = Counter(zip(dtypes, shapes, strict=True))
    spelled = sum((len(d) + len(s)) * k for (d, s), k in counts.items())
    length = n * _FIXED + len(joined) - (n - 1) + spelled + sum(map(len, starts)) + sum(map(len, ends))
    if not _END.fullmatch(body, begin + length - 1):  # the matches tile [begin, end): no byte between them
        return None
    if body is raw:
        meta = _metadata(raw[:begin])
        if meta is None:
            return None
    elif begin != 0:
        return None
    else:
        meta = {}
    kinds, ids = [], {}  # the distinct (dtype, shape, bytes); each's index, by its spelling
    for key in counts:
        dtype = key[0].decode("ascii")
        if dtype not in itemsize or not _DIMS.fullmatch(key[1]):
            return None
        shape = tuple(map(int, key[1].split(b","))) if key[1] else ()
        ids[key] = len(kinds)
        kinds.append((dtype, shape, math.prod(shape) * itemsize[dtype]))
    kind_ids = list(map(ids.__getitem__, zip(dtypes, shapes, strict=True)))
    nbytes = list(map(_NBYTES, map(kinds.__getitem__, kind_ids)))
    first_byte = list(map(int, starts))
    past = list(map(int, ends))
    if list(map(operator.sub, past, first_byte)) != nbytes:  # each span as long as its shape needs
        return None
    if first_byte[1:] != past[:-1]:  # back to back in header order (from 0: above), those of no bytes too
        return None
    if past[-1] != size - (8 + len(raw)):  # the data covered exactly
        return None
    offsets = list(map((8 + len(raw)).__add__, first_byte))
    return Columns(joined, kinds, kind_ids, offsets), meta


def _metadata(head: bytes) -> dict[str, str] | None:
    """The `__metadata__` object that `head` (`{"__metadata__":{...}`) holds, if it holds only that."""
    obj = json.loads(head + b"}")
    if type(obj) is not dict or list(obj) != ["__metadata__"]:
        return None
    meta = obj["__metadata__"]
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        return None
    return meta
