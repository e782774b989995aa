"""An in-memory reading of a plan with torch, to check the streaming executor against.

It knows nothing about vLLM: it only says what bytes a plan's pieces denote. Whether the plan is
right is `make test-vllm`'s job.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from reshard.plan import Fill, OutTensor, Slice

TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}


def load_source(root, ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for name in ckpt.files:
        with safe_open(str(root / name), "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = f.get_tensor(k)
    return out


def materialize(t: OutTensor, source: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = TORCH[t.dtype]
    parts = []
    for p in t.pieces:
        if isinstance(p, Fill):
            parts.append(torch.full((p.count,), p.value, dtype=torch.float32).to(dtype).view(torch.uint8))
            continue
        assert isinstance(p, Slice)
        x = source[p.source]
        if p.up:
            for dim, k in enumerate(p.up):
                x = x.repeat_interleave(k, dim=dim)
        idx = tuple(slice(a, b) for a, b in zip(p.start, p.stop, strict=True))
        parts.append(x[idx].to(dtype).contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts).view(dtype).reshape(t.shape)
