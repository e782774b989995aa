"""The compact header's bulk parse: whatever it accepts, `parse_header` would have returned the same;
whatever it refuses is parsed (and refused) by the general parser, with its errors."""

from __future__ import annotations

import json
import math
import random
import re
import struct

import pytest
import torch
from safetensors.torch import save

import reshard.format as fmt
from reshard import fastheader
from reshard.errors import SourceError
from reshard.format import ITEMSIZE, TensorInfo, encode_header, parse_header

ENTRIES = [
    ("model.embed_tokens.weight", "BF16", (16, 8)),
    ("model.layers.0.mlp.experts.0.down_proj.weight", "BF16", (8, 4)),
    ("empty", "F32", (0, 3)),
    ("scalar", "F32", ()),
    ("model.layers.0.self_attn.q_proj.weight", "F8_E4M3", (8, 8)),
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", "F32", (1, 1)),
    ("é名\U0001f600", "I64", (2,)),  # raw UTF-8 in a name (ensure_ascii=False below)
]


def compact(entries=ENTRIES, metadata: dict | None = None, base: int = 0) -> tuple[bytes, int]:
    """A header as the format's writers spell it (non-ASCII names as raw UTF-8), and its file's size;
    `base`: where the first tensor's bytes begin in the data section (0 but in a damaged file)."""
    obj: dict = {"__metadata__": metadata} if metadata is not None else {}
    pos = base
    for name, dtype, shape in entries:
        n = ITEMSIZE[dtype] * math.prod(shape)
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, 8 + len(raw) + pos


def resized(raw: bytes, size: int, changed: bytes) -> int:
    """The size of `raw`'s file with `changed` in place of its header: the same data section."""
    return size + len(changed) - len(raw)


def general(raw: bytes, size: int, monkeypatch) -> tuple:
    """What `parse_header` gives without the compact path: the records, or the error's message."""
    with monkeypatch.context() as m:
        m.setattr(fmt, "parse_compact", lambda *a: None)
        return outcome(raw, size)


def outcome(raw: bytes, size: int) -> tuple:
    try:
        tensors, meta, got_size = parse_header(raw, size, "/ckpt/x.safetensors", "x.safetensors")
    except SourceError as e:
        return ("error", str(e))
    return ("ok", [(k, tuple(v), [type(f) for f in v]) for k, v in tensors.items()], meta, got_size)


def fast(raw: bytes, size: int):
    return fastheader.parse_compact(raw, size, "x.safetensors", ITEMSIZE, TensorInfo)


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {"a": 'x,"y":{"dtype"', "b": "\\"}])
def test_compact_headers_take_the_bulk_path_and_give_the_same(metadata, monkeypatch):
    raw, size = compact(metadata=metadata)
    assert fast(raw, size) is not None  # the comparison below compares the bulk path
    assert outcome(raw, size) == general(raw, size, monkeypatch)
    tensors, meta, _ = parse_header(raw, size, "w", "x.safetensors")
    assert meta == (metadata or {})
    assert tensors["é名\U0001f600"] == TensorInfo("é名\U0001f600", "I64", (2,), "x.safetensors", 8 + len(raw) + 392, 16)


def test_the_safetensors_librarys_own_file_takes_the_bulk_path():
    tensors = {"b": torch.ones(3, 5).bfloat16(), "a": torch.randn(7), "z": torch.tensor(1.0), "e": torch.zeros(0, 2)}
    data = save(tensors, metadata={"format": "pt"})
    n = struct.unpack("<Q", data[:8])[0]
    got = fast(data[8 : 8 + n], len(data))
    assert got is not None
    assert {k: (v.dtype, v.shape, v.nbytes) for k, v in got[0].items()} == {
        "a": ("F32", (7,), 28),
        "z": ("F32", (), 4),
        "e": ("F32", (0, 2), 0),
        "b": ("BF16", (3, 5), 30),
    }
    assert got[1] == {"format": "pt"}


def test_readers_own_encoding_takes_the_bulk_path():
    raw = encode_header([(n, d, s) for n, d, s in ENTRIES if n.isascii()], {"format": "pt"}, align=4096)
    size = len(raw) + sum(ITEMSIZE[d] * math.prod(s) for n, d, s in ENTRIES if n.isascii())
    assert fast(raw[8:], size) is not None


SPELLINGS = {  # a header spelled otherwise than compactly, or damaged: the general parser's
    "spaces": lambda raw: raw.replace(b'":{', b'": {', 1),
    "escape in a name": lambda raw: raw.replace(b'"scalar"', b'"sc\\u0061lar"'),
    "metadata last": lambda raw: raw.replace(b'{"__metadata__":{"format":"pt"},', b"{").replace(
        b"}}", b'},"__metadata__":{"format":"pt"}}', 1
    ),
    "duplicate name": lambda raw: raw.replace(b'"empty"', b'"scalar"'),
    "duplicate name with bytes": lambda raw: raw.replace(
        b'"model.layers.0.mlp', b'"model.embed_tokens.weight"', 1
    ).replace(b'.experts.0.down_proj.weight"', b"", 1),
    "overlapping spans": lambda raw: raw.replace(b"[256,320]", b"[250,314]"),
    "a metadata value not a string": lambda raw: raw.replace(b'"format":"pt"', b'"format":1'),
    "a zero-size tensor past the end": lambda raw: raw.replace(
        b'"empty":{"dtype":"F32","shape":[0,3],"data_offsets":[320,320]}',
        b'"empty":{"dtype":"F32","shape":[0,3],"data_offsets":[999,999]}',
    ),
    "a tensor named __metadata__": lambda raw: raw.replace(b'"empty"', b'"__metadata__"'),
    "out of order": lambda raw: _swap_first_two(raw),
    "leading zero in an offset": lambda raw: raw.replace(b"[0,256]", b"[00,256]"),
    "leading zero in a dim": lambda raw: raw.replace(b"[16,8]", b"[016,8]"),
    "a float dim": lambda raw: raw.replace(b"[16,8]", b"[16.0,8]"),
    "an unknown dtype": lambda raw: raw.replace(b'"F8_E4M3"', b'"F8_E3M4"'),
    "an extra key": lambda raw: raw.replace(b"[0,256]}", b'[0,256],"x":1}'),
    "bytes between entries": lambda raw: raw.replace(b'},"empty"', b'},,"empty"'),
    "a short span": lambda raw: raw.replace(b"[0,256]", b"[0,255]"),
    "a hole": lambda raw: raw.replace(b"[0,256]", b"[2,258]"),
    "one more byte after the header": lambda raw: raw + b"x",
    "a NUL after the header": lambda raw: raw.rstrip() + b"\x00",
    "newline and tab after it": lambda raw: raw.rstrip() + b"\n\t ",
    "an int too long for int()": lambda raw: raw.replace(b"[16,8]", b"[" + b"1" * 5000 + b",8]"),
    "not utf-8": lambda raw: raw.replace("é".encode(), b"\xff"),
    "a control character in a name": lambda raw: raw.replace(b'"empty"', b'"emp\x01ty"'),
    "a byte-order mark": lambda raw: b"\xef\xbb\xbf" + raw,
    "the last entry ends the header": lambda raw: raw.rstrip()[:-1] + b" ",
}


def _swap_first_two(raw: bytes) -> bytes:
    """The first two entries' text swapped: their offsets no longer run in header order."""
    first, second = re.findall(rb',"[^"]*":\{[^}]*\}', raw)[:2]
    return raw.replace(first + second, second + first)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_other_spellings_give_what_the_general_parser_gives(spelling, monkeypatch):
    raw, size = compact(metadata={"format": "pt"})
    changed = SPELLINGS[spelling](raw)
    assert changed != raw
    for s in (resized(raw, size, changed), size):
        assert outcome(changed, s) == general(changed, s, monkeypatch)


@pytest.mark.parametrize("entries", [ENTRIES, [("z", "F32", (0,)), ("a", "F32", (2,))]])
def test_a_hole_before_the_first_tensor(entries, monkeypatch):
    """Also behind a first tensor of no bytes, which may sit anywhere."""
    raw, size = compact(entries, metadata={"format": "pt"}, base=2)
    assert fast(raw, size) is None
    assert outcome(raw, size)[0] == "error" and outcome(raw, size) == general(raw, size, monkeypatch)


def test_an_entry_hidden_in_the_metadata_is_not_one(monkeypatch):
    """The regular expression finds an entry-shaped object inside `__metadata__`: its matches do not
    tile the header, so the general parser decides (and refuses a metadata object that is not strings)."""
    raw, size = compact(metadata={"format": "pt"})
    inner = b'{"format":"pt","x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    changed = raw.replace(b'{"format":"pt"}', inner)
    assert fast(changed, size) is None
    assert outcome(changed, size)[0] == "error" and outcome(changed, size) == general(changed, size, monkeypatch)


def test_a_gap_that_the_lengths_alone_would_not_show(monkeypatch):
    """One byte between two entries and the header's closing brace taken by the last entry: the
    matches' lengths still sum to the span, which only the `}}` at its end tells apart."""
    raw, size = compact(metadata={"format": "pt"})
    body = raw.rstrip()
    changed = body.replace(b'},"empty"', b'}x,"empty"')[:-1] + b" "
    size = resized(raw, size, changed)
    assert fast(changed, size) is None
    assert outcome(changed, size)[0] == "error" and outcome(changed, size) == general(changed, size, monkeypatch)


@pytest.mark.parametrize("seed", range(6))
def test_damaged_bytes_give_what_the_general_parser_gives(seed, monkeypatch):
    """Random bytes changed, dropped or doubled: the same records or the same error, every time."""
    rng = random.Random(seed)
    raw, size = compact(metadata={"format": "pt"})
    taken = 0
    for _ in range(150):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            op = rng.randrange(3)
            if op == 0:
                b[i] = rng.choice(b'0123456789,:{}[]"\\ x\x00\xc3')
            elif op == 1:
                del b[i]
            else:
                b[i:i] = b[i : i + rng.randint(1, 40)]
        changed = bytes(b)
        fitted = resized(raw, size, changed)
        for s in (fitted, fitted - 1, fitted + 1):
            assert outcome(changed, s) == general(changed, s, monkeypatch), changed
            taken += fast(changed, s) is not None
    assert taken  # some changes the bulk path accepted (a digit of a name, say): it was exercised


def test_columns_rebuild_the_records():
    raw, size = compact()
    columns, meta = fastheader.scan(raw, size, ITEMSIZE)
    assert meta == {}
    assert fastheader.build(columns, "x.safetensors", TensorInfo) == fast(raw, size)[0]
    damaged = columns._replace(offsets=columns.offsets[:-1])
    assert fastheader.build(damaged, "x.safetensors", TensorInfo) is None
