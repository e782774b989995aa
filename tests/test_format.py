"""The hand-written safetensors header: identical to the library's, and strict when reading."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from reshard.errors import SourceError
from reshard.format import encode_header, read_header


def test_header_bytes_equal_safetensors_library():
    tensors = {
        "a": torch.randn(7),
        "z": torch.tensor(1.0),
        "b": torch.randn(3, 5).bfloat16(),
        "c": torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
    }
    raw = save(tensors, metadata={"format": "pt"})
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    mine = encode_header([(k, header[k]["dtype"], tuple(header[k]["shape"])) for k in order], meta)
    assert mine == raw[: 8 + n]


def _write(tmp_path, raw: bytes):
    p = tmp_path / "x.safetensors"
    p.write_bytes(raw)
    return p


def test_read_header_roundtrip(tmp_path):
    raw = save({"w": torch.ones(4, 3, dtype=torch.bfloat16), "s": torch.tensor(2.0)})
    tensors, _meta, size = read_header(_write(tmp_path, raw))
    assert size == len(raw)
    assert tensors["w"].shape == (4, 3) and tensors["w"].dtype == "BF16" and tensors["w"].nbytes == 24
    assert tensors["s"].shape == () and tensors["s"].nbytes == 4


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw[:5], "truncated"),
        (lambda raw: struct.pack("<Q", 10**9) + raw[8:], "header length"),
        (lambda raw: raw[:8] + b"x" + raw[9:], "corrupt"),
        (lambda raw: raw[:-3], "truncated"),
    ],
    ids=["short", "hostile-length", "bad-json", "cut-data"],
)
def test_read_header_rejects_damage(tmp_path, mutate, message):
    raw = save({"w": torch.ones(4, 3), "v": torch.ones(2)})
    with pytest.raises(SourceError, match=message):
        read_header(_write(tmp_path, mutate(raw)))


def test_read_header_rejects_overlap(tmp_path):
    obj = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(obj).encode()
    raw += b" " * (-len(raw) % 8)
    with pytest.raises(SourceError, match="overlaps"):
        read_header(_write(tmp_path, struct.pack("<Q", len(raw)) + raw + bytes(12)))


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "spaced"])
def test_tensors_of_no_bytes_where_the_safetensors_library_takes_them(tmp_path, compact):
    """A tensor of no bytes must begin where a tensor ends (or at 0): the safetensors library, so
    vLLM, refuses one inside another's bytes or behind a hole ("invalid offset"). Both parsers (the
    bulk one takes the compact spelling) accept exactly what the library accepts."""
    from safetensors import safe_open

    a = ("a", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})
    b = ("b", {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]})
    verdicts = []
    for at in (0, 4, 8, 12, 16, 24):
        z = ("z", {"dtype": "BF16", "shape": [0, 3], "data_offsets": [at, at]})
        for order in ([z, a, b], [a, z, b], [a, b, z]):
            raw = json.dumps(dict(order), separators=(",", ":") if compact else (", ", ": ")).encode()
            raw += b" " * (-len(raw) % 8)
            path = _write(tmp_path, struct.pack("<Q", len(raw)) + raw + bytes(16))
            try:
                with safe_open(path, "np") as f:
                    library = sorted(f.keys()) == ["a", "b", "z"]
            except Exception:  # the library's SafetensorError
                library = False
            try:
                ours = sorted(read_header(path)[0]) == ["a", "b", "z"]
            except SourceError:
                ours = False
            verdicts.append((at, [k for k, _ in order], library, ours))
    assert [v for v in verdicts if v[2] != v[3]] == []
    assert {v[2] for v in verdicts} == {True, False}  # both verdicts met


def test_records_are_the_tensor_infos_a_manifest_names():
    """`records`: (dtype, shape) by name as TensorInfo at offset 0 of one file, sizes from the shapes, in order."""
    from reshard.format import TensorInfo, records

    src = {"b.w": ("BF16", (3, 4)), "a.s": ("F32", ()), "c.e": ("F8_E4M3", (0, 7)), "d.w": ("BF16", (3, 4))}
    got = records(src, "virtual")
    assert list(got) == list(src)
    assert got == {
        n: TensorInfo(n, d, s, "virtual", 0, {"BF16": 24, "F32": 4, "F8_E4M3": 0}[d]) for n, (d, s) in src.items()
    }
    assert all(type(t) is TensorInfo for t in got.values())
