"""The safetensors header parser's bulk path (issue 28) answers exactly as the entry-by-entry parser it
replaced: the same tensors (names, order, dtypes, shapes, offsets) and metadata, or the same error,
on tricky and on generated headers. `old_parse_header` is a verbatim copy of that parser."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.errors import SourceError
from reshard.format import ITEMSIZE, TensorInfo, parse_header


def old_parse_header(raw: bytes, size: int, where: str, file_name: str):
    path = where
    n = len(raw)
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SourceError(f"{path}: corrupt safetensors header ({str(e)[:200]})", _REDOWNLOAD) from e
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)", _REDOWNLOAD)
    start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in obj.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not isinstance(dtype, str) or not all(_is_int(x) for x in (*shape, begin, end)):
                raise TypeError("dtype must be a string, shape and data_offsets integers")
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(f"{path}: corrupt header entry for {name!r}", _REDOWNLOAD) from e
        if any(d < 0 for d in shape):
            raise SourceError(f"{path}: tensor {name!r} has a negative dimension {list(shape)}", _REDOWNLOAD)
        if dtype not in ITEMSIZE:  # since session 16: with a hint
            raise SourceError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype}",
                f"reshard reads the safetensors dtypes ({', '.join(ITEMSIZE)}); convert the checkpoint first",
            )
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if begin < 0:  # since session 16: its own message (the span's was self-contradictory)
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
        tensors[name] = TensorInfo(name, dtype, shape, file_name, start + begin, nbytes)
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:  # since session 24: a tensor of no bytes too, as the safetensors library ("invalid offset")
            raise SourceError(f"{path}: tensor {name!r} overlaps or leaves a hole", _REDOWNLOAD)
        pos = end
    if start + pos != size:  # since session 17: bytes after the last tensor, as the safetensors library
        raise SourceError(
            f"{path}: {size - start - pos} bytes after its last tensor, which the safetensors library "
            "(and vLLM) refuses",
            _REDOWNLOAD,
        )
    return tensors, {str(k): str(v) for k, v in meta.items()}, size


_REDOWNLOAD = "the file is damaged or partly downloaded: download it again"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def outcome(parse, raw: bytes, size: int):
    """What a parser makes of `raw`: its tensors as plain values (order kept) and metadata, or its error."""
    try:
        tensors, meta, got = parse(raw, size, "/x/model.safetensors", "model.safetensors")
    except SourceError as e:
        return ("error", e.message, e.hint)
    rows = [(k, t.name, t.dtype, t.shape, type(t.shape), t.file, t.offset, t.nbytes) for k, t in tensors.items()]
    return ("ok", rows, meta, got)


def data_end(raw: bytes) -> int:
    """Where the data of the header `raw` ends (the largest end offset of its entries that have one),
    relative to the data's start: the size at which a well-formed file is exactly covered."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return 0
    offsets = [e.get("data_offsets") for e in obj.values() if isinstance(e, dict)] if isinstance(obj, dict) else []
    return max([o[-1] for o in offsets if isinstance(o, list) and o and _is_int(o[-1])] + [0])


def same(raw: bytes, size: int | None = None) -> None:
    size = 8 + len(raw) + data_end(raw) if size is None else size
    assert outcome(parse_header, raw, size) == outcome(old_parse_header, raw, size)


def entry(dtype="BF16", shape=(2, 3), begin=0, end=None, **extra) -> dict:
    end = begin + math.prod(shape) * ITEMSIZE.get(dtype, 1) if end is None else end
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end], **extra}


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()


TRICKY = {
    "plain": {"a": entry(), "b": entry(begin=12)},
    "offsets out of name order": {"a": entry(begin=12), "b": entry()},
    "metadata": {"__metadata__": {"format": "pt"}, "a": entry()},
    "metadata not strings": {"__metadata__": {"format": 1}, "a": entry()},
    "metadata spelled as an entry": {"__metadata__": entry(), "a": entry()},
    "metadata null": {"__metadata__": None, "a": entry()},
    "zero-size tensors": {"e": entry(shape=(0, 4), begin=5, end=5), "a": entry(), "z": entry(shape=(), begin=12)},
    "zero-size at 0 and a tensor": {"e": entry(shape=(0,), begin=0, end=0), "a": entry()},
    "scalar": {"s": entry(dtype="F32", shape=())},
    "keys in another order": {"a": {"shape": [2, 3], "dtype": "BF16", "data_offsets": [0, 12]}},
    "an extra key": {"a": entry(extra=1)},
    "a missing key": {"a": {"dtype": "BF16", "shape": [1]}},
    "duplicate key in an entry": b'{"a": {"dtype": "F32", "dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}',
    "duplicate tensor name": b'{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}, '
    b'"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}',
    "bool dimension": {"a": entry(shape=(True, 2), end=4)},
    "bool dimension after an int one": {"b": entry(shape=(1, 2), end=4), "a": entry(shape=(True, 2), begin=4, end=8)},
    "float dimension": {"a": {"dtype": "BF16", "shape": [2.0], "data_offsets": [0, 4]}},
    # the hook's cache of shapes is keyed with each dimension's type: an int's shape is never found for another's
    "int dimension after a bool one": {"a": entry(shape=(True, 2), end=4), "b": entry(shape=(1, 2), begin=4, end=8)},
    "float dimension after an int one": {
        "b": entry(shape=(2,)),
        "a": {"dtype": "BF16", "shape": [2.0], "data_offsets": [4, 8]},
    },
    "list dimension": {"b": entry(shape=(2,)), "a": {"dtype": "BF16", "shape": [[2]], "data_offsets": [4, 8]}},
    "object dimension": {"a": {"dtype": "BF16", "shape": [{"n": 2}], "data_offsets": [0, 4]}},
    "null dimension": {"a": {"dtype": "BF16", "shape": [None], "data_offsets": [0, 4]}},
    "float offset": {"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4.0]}},
    "bool offset": {"a": {"dtype": "BF16", "shape": [1], "data_offsets": [False, 2]}},
    "negative dimension": {"a": entry(shape=(-2, 3), end=12)},
    "negative dimension, span to match": {"b": entry(), "a": entry(shape=(-2, 3), begin=24, end=12)},
    "negative begin": {"a": entry(begin=-12, end=0)},
    "unknown dtype": {"a": entry(dtype="F128")},
    "dtype not a string": {"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 1]}},
    "shape a string": {"a": {"dtype": "U8", "shape": "12", "data_offsets": [0, 1]}},
    "shape an entry": {"a": {"dtype": "U8", "shape": entry(), "data_offsets": [0, 1]}},
    "offsets an entry": {"a": {"dtype": "U8", "shape": [1], "data_offsets": entry()}},
    "three offsets": {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}},
    "one offset": {"a": {"dtype": "U8", "shape": [1], "data_offsets": [1]}},
    "wrong span": {"a": entry(end=11)},
    "hole": {"a": entry(), "b": entry(begin=14)},
    "hole at the start": {"a": entry(begin=2)},
    "overlap": {"a": entry(), "b": entry(begin=6)},
    "same begin": {"a": entry(), "b": entry(shape=(3,), begin=0)},
    "same span twice": {"a": entry(), "b": entry()},
    "entry a list": {"a": [1, 2, 3]},
    "entry a string": {"a": "x"},
    "entry null": {"a": None},
    "header spelled as an entry": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
    "header a list": [entry()],
    "not JSON": b"{nope",
    "not UTF-8": b'{"a\xff": 1}',
    "nested too deep": b"[" * 100_000 + b"]" * 100_000,
    "empty header": {},
}

# the file's size past the exact end of its data: bytes after the last tensor (refused, as safetensors does)
TRAILING = {"plain, 1 byte after": ({"a": entry(), "b": entry(begin=12)}, 1), "empty header, 8 after": ({}, 8)}


@pytest.mark.parametrize("case", TRAILING)
def test_bytes_after_the_last_tensor_are_refused(case):
    obj, extra = TRAILING[case]
    raw = dumps(obj)
    same(raw, 8 + len(raw) + data_end(raw) + extra)
    with pytest.raises(SourceError, match=f"{extra} bytes after its last tensor"):
        parse_header(raw, 8 + len(raw) + data_end(raw) + extra, "x", "x")


@pytest.mark.parametrize("case", TRICKY)
def test_tricky_headers_parse_as_before(case):
    obj = TRICKY[case]
    same(obj if isinstance(obj, bytes) else dumps(obj))


def test_truncated_file_errors_as_before():
    raw = dumps({"a": entry(), "b": entry(begin=12)})
    for size in (8 + len(raw) + 24, 8 + len(raw) + 23, 8 + len(raw) + 12, 8 + len(raw)):
        same(raw, size)


def test_shared_shapes_are_equal_tuples():
    raw = dumps({f"t{i}": entry(shape=(4, 8), begin=64 * i) for i in range(10)})
    tensors, _, _ = parse_header(raw, 8 + len(raw) + 640, "x", "x")
    shapes = {id(t.shape) for t in tensors.values()}
    assert len(shapes) == 1 and next(iter(tensors.values())).shape == (4, 8)


dims = st.one_of(st.integers(-2, 5), st.booleans(), st.just(2.0))
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["BF16", "F32", "U8", "F8_E4M3", "X", 3]),
        "shape": st.lists(dims, max_size=3),
        "data_offsets": st.lists(st.integers(-4, 400), min_size=1, max_size=3),
    }
)


@st.composite
def headers(draw) -> bytes:
    """Mostly well-formed headers (tensors back to back in a random order), some entries broken."""
    n = draw(st.integers(0, 8))
    order = draw(st.permutations(range(n)))
    names = [f"t{i}" for i in range(n)]
    shapes = [draw(st.lists(st.integers(0, 4), max_size=3)) for _ in range(n)]
    dtypes = [draw(st.sampled_from(["BF16", "F32", "U8"])) for _ in range(n)]
    obj, pos = {}, 0
    for i in order:
        nbytes = math.prod(shapes[i]) * ITEMSIZE[dtypes[i]]
        obj[names[i]] = {"dtype": dtypes[i], "shape": shapes[i], "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    for _ in range(draw(st.integers(0, 2))):
        if obj and draw(st.booleans()):
            victim = draw(st.sampled_from(sorted(obj)))
            obj[victim] = draw(entries)
    if draw(st.booleans()):
        obj = dict(sorted(obj.items()))
    return dumps(obj)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(headers(), st.one_of(st.just(0), st.integers(-30, 200)))
def test_generated_headers_parse_as_before(raw, slack):
    """Sizes exact (the data fully covers the file), short (truncated) and long (bytes after it)."""
    same(raw, 8 + len(raw) + max(0, data_end(raw) + slack))
