"""Element bytes in another dtype: casts (exactly as torch's `.to()`), fill values, and the two
array transforms pieces may need (padding, up-sampling).

Dtypes are safetensors codes ("BF16", ...); the torch dtype of a code is the one `reshard.format`
names for it (`DTYPE_CODES`). torch is imported only when a cast needs it.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.optional import import_torch


def pad_rows(arr: np.ndarray, pad: tuple[int, ...], value: float, dtype: str) -> np.ndarray:
    """Rows of `arr` ([rows, *inner, itemsize] uint8) at the origin of [rows, *pad[1:]], `value` elsewhere."""
    shape = (arr.shape[0], *pad[1:])
    out = np.frombuffer(bytearray(fill_bytes(value, math.prod(shape), dtype)), np.uint8).reshape(
        (*shape, arr.shape[-1])
    )
    out[tuple(slice(0, n) for n in arr.shape[:-1])] = arr
    return out


def upsample(arr: np.ndarray, up: tuple[int, ...]) -> np.ndarray:
    """`arr` with every element repeated `up[d]` times along dim d (block scales to finer blocks)."""
    for dim, k in enumerate(up):
        if k > 1:
            arr = np.repeat(arr, k, axis=dim)
    return arr


def fill_bytes(value: float, count: int, dtype: str) -> bytes:
    """`count` elements of `dtype`, each `value` (zeros in any dtype; other values in float dtypes, whole
    numbers in integer ones)."""
    if value == 0.0:
        return bytes(count * ITEMSIZE[dtype])
    if dtype == "F32":
        return np.full(count, value, np.float32).tobytes()
    if dtype == "F16":
        return np.full(count, value, np.float16).tobytes()
    if dtype == "BF16":
        bits = np.full(count, value, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype(np.uint16).tobytes()
    ints = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
    if dtype in ints and value == int(value):
        return np.full(count, int(value), ints[dtype]).tobytes()
    raise ValueError(f"cannot fill {dtype} with {value}")


class Caster:
    """Converts element bytes between dtypes exactly as torch's `.to()` (what vLLM's copy_ does).

    With device != "cpu" every piece also goes through that device (`--device cuda`).
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._torch: ModuleType | None = None

    def torch(self) -> ModuleType:
        if self._torch is None:
            why = "converting tensors between dtypes" if self.device == "cpu" else f"--device {self.device}"
            self._torch = import_torch(why)
        return self._torch

    def __call__(self, data: np.ndarray, src: str, dst: str) -> np.ndarray:
        """`data` (uint8, [..., itemsize of src]) as `dst` elements: `data` itself when nothing changes.
        I32 -> U8 is not a cast but vLLM's `.view(torch.uint8)` of int32-packed weights (MoeWNA16's
        experts, reshard.plan.gptq): the same bytes, four elements each."""
        if (src, dst) == ("I32", "U8"):
            return np.ascontiguousarray(data).reshape(*data.shape[:-2], data.shape[-2] * 4, 1)
        if src == dst and self.device == "cpu":
            return data
        if self.device == "cpu" and dst == "F32" and src in ("BF16", "F16"):
            if src == "F16":
                return data.view(np.float16).astype(np.float32).view(np.uint8)
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.uint8)
        torch = self.torch()
        t = torch.from_numpy(np.ascontiguousarray(data)).view(self._dtype(src))
        if self.device != "cpu":
            t = t.to(self.device)
        t = t.to(self._dtype(dst)).contiguous()
        return t.view(torch.uint8).cpu().numpy()

    def _dtype(self, code: str):  # a torch.dtype
        return getattr(self.torch(), DTYPE_CODES[code])


def dequantize_fp8(
    part: np.ndarray,
    shape: tuple[int, ...],
    scale: np.ndarray,
    scale_dtype: str,
    scale_shape: tuple[int, ...],
    row: int,
    col: int,
) -> np.ndarray:
    """Block-FP8 (e4m3) weight bytes as bfloat16 bytes, exactly as vLLM's `scaled_dequantize(w, s,
    group_shape=(rows // s_rows, cols // s_cols), out_dtype=bfloat16)`: both to float32, multiplied
    elementwise, rounded to bfloat16 (deepseek_v2._try_load_fp8_indexer_wk; E8M0 scales decoded first).

    part: uint8 [n, c, 1], rows [row, row + n) and columns [col, col + c) of the [rows, cols] weight `shape`;
    scale: the whole scale tensor's bytes ([s_rows, s_cols, itemsize] uint8) of `scale_dtype`."""
    torch = import_torch("dequantizing an FP8 weight")
    gr, gc = shape[0] // scale_shape[0], shape[1] // scale_shape[1]
    n, c = part.shape[0], part.shape[1]
    w = torch.from_numpy(np.ascontiguousarray(part)).view(torch.float8_e4m3fn).reshape(n, c)
    raw = torch.from_numpy(np.ascontiguousarray(scale))
    if scale_dtype in ("F8_E8M0", "U8"):
        s = raw.view(torch.float8_e8m0fnu).to(torch.float32)
    else:
        s = raw.view(getattr(torch, DTYPE_CODES[scale_dtype])).to(torch.float32)
    s = s.reshape(scale_shape)
    rows = torch.arange(row, row + n) // gr
    cols = torch.arange(col, col + c) // gc
    full = s[rows][:, cols]
    out = (w.to(torch.float32) * full).to(torch.bfloat16)
    return out.contiguous().view(torch.uint8).numpy().reshape(n, c, 2)
