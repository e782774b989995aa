"""vLLM's `--moe-backend`: which routed-expert layout each backend makes vLLM allocate before loading.

Read from vLLM 0.32 (identical in 0.33), `model_executor/layers/fused_moe/`:

- Block-FP8 experts (`quant_method: fp8` with `weight_block_size`, `Fp8MoEMethod.__init__`):
  `oracle/fp8.py:resolve_fp8_moe_weight_block_shape`. With `auto` a per-rank intermediate size
  that cuts a checkpoint block is served by refining the scale grid (`refine_fp8_moe_block_shape`),
  whatever the GPU. A backend named explicitly whose kernels cannot take the refined block
  (everything but Triton: `_supports_quant_scheme` only lists 128x128 blocks) makes vLLM pad
  instead (`pad_tp_shard_to_weight_blocks`): the per-rank size is rounded up to whole blocks and
  rank r holds rows [r * padded, (r + 1) * padded) of the unsharded intermediate dim, zero weights
  and 1.0 scales past its end (`RoutedExperts._load_model_weight_or_group_weight_scale`).
- Unquantized experts (`UnquantizedFusedMoEMethod.maybe_roundup_sizes`):
  `oracle/unquantized.py:unquantized_round_up_hidden_size_and_intermediate_size`. FlashInfer
  TRT-LLM (what `auto` picks on Blackwell when FlashInfer is usable and the routing qualifies)
  rounds the per-rank intermediate size up to 128, ROCm AITER to 64 or 128; the loader puts gate
  rows at 0, up rows at the padded offset and down's real columns first, and post-processing
  zeroes the rest (`_zero_intermediate_padding`). A Triton layout loads into such parameters
  without an error and is silently wrong, so `auto` writes Triton's layout and pins it.
- Per-tensor FP8, per-channel and compressed-tensors experts: no backend changes the layout.
"""

from __future__ import annotations

import math

from reshard import VLLM_LAYOUT
from reshard.errors import UnsupportedError

# vLLM's --moe-backend names (fused_moe/oracle): the serve line pins one where the MoE layout depends on it
MOE_BACKENDS = ("auto", "triton", "batched_triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass",
                "marlin", "humming", "aiter", "hpc",
                "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl", "flashinfer_b12x", "b12x", "emulation")  # fmt: skip

# vLLM 0.32's MoEBackend names (config/kernel.py) that its FP8 or unquantized oracles accept
# oracle/fp8.py map_fp8_backend
FP8_BACKENDS = ("triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass", "marlin",
                "humming", "aiter", "hpc")  # fmt: skip
# oracle/unquantized.py map_unquantized_backend ("humming" falls back to auto there)
UNQUANTIZED_BACKENDS = ("triton", "batched_triton", "flashinfer_trtllm", "flashinfer_cutlass", "aiter", "humming")
# the only FP8 kernels that take a refined (non-128) block: TritonExperts, block shape at run time
REFINING_FP8_BACKENDS = ("triton",)


def check_backend(name: str) -> str:
    if name not in MOE_BACKENDS:
        raise UnsupportedError(f"--moe-backend {name!r} is not one of vLLM's: {', '.join(MOE_BACKENDS)}")
    return name


def fp8_block_pads(backend: str, block: tuple[int, int], ip: int, moe_tp: int, refinable: bool) -> bool:
    """resolve_fp8_moe_weight_block_shape: whether vLLM pads the TP shard to whole blocks."""
    bn, bk = block
    if backend == "auto" or bn != bk or moe_tp == 1 or ip % bn == 0:
        return False
    if backend == "cutlass":
        raise UnsupportedError(
            "--moe-backend cutlass: vLLM's CUTLASS FP8 MoE backend is disabled for `quant_method: fp8` experts",
            f"use one of {', '.join(b for b in FP8_BACKENDS if b != 'cutlass')}",
        )
    if backend not in FP8_BACKENDS:
        raise UnsupportedError(
            f"--moe-backend {backend} does not run FP8 experts in vLLM", f"use one of {', '.join(FP8_BACKENDS)}"
        )
    return not (refinable and backend in REFINING_FP8_BACKENDS)


def unquantized_alloc(backend: str, ip: int) -> int:
    """unquantized_round_up_hidden_size_and_intermediate_size: the per-rank allocation."""
    if backend == "flashinfer_trtllm":
        return -(-ip // 128) * 128
    if backend == "aiter":
        align = 64 if ip <= 192 else 128  # aiter_moe_intermediate_alignment
        return -(-ip // align) * align
    if backend != "auto" and backend not in UNQUANTIZED_BACKENDS:
        raise UnsupportedError(
            f"--moe-backend {backend} does not run unquantized experts in vLLM",
            f"use one of {', '.join(UNQUANTIZED_BACKENDS)}",
        )
    return ip


def unquantized_depends(ip: int) -> bool:
    """Whether some backend `auto` may pick (TRT-LLM on Blackwell, AITER on ROCm) allocates more."""
    return any(unquantized_alloc(b, ip) != ip for b in ("flashinfer_trtllm", "aiter"))


def pin_note(ip: int, padded: int) -> str:
    return (
        f"serve line pins --moe-backend triton: the experts' per-rank intermediate size {ip} is not a "
        f"multiple of 128, and vLLM's auto on Blackwell (FlashInfer TRT-LLM) allocates {padded} and would load "
        "this Triton layout silently wrong. Cost: Triton instead of TRT-LLM on B200 (slower MoE); TRT-LLM's "
        "layout is `--moe-backend flashinfer_trtllm` (it then loads only with that backend, on Blackwell)"
    )


def refined_block(block: tuple[int, int], ip: int, moe_tp: int, hidden: int) -> int | None:
    """oracle/fp8.py refine_fp8_moe_block_shape: the finer square block vLLM refines to, if any."""
    bn, bk = block
    if ip % bn == 0 and (moe_tp == 1 or ip % bk == 0):
        return None
    f = math.gcd(bn, bk, ip, hidden)
    return f if f >= 32 else None


def round_note(backend: str, ip: int, alloc: int) -> str:
    return (
        f"--moe-backend {backend}: vLLM allocates the experts' per-rank intermediate size {ip} rounded up to "
        f"{alloc} (gate rows first, up rows from {alloc}, down's real columns first, zeros elsewhere); the serve "
        "line pins the backend: this layout loads silently wrong with any other"
    )


def pad_note(backend: str, ip: int, alloc: int, inter: int, tp: int) -> str:
    full = -(-inter // alloc)
    empty = f"; ranks {full}-{tp - 1} hold only zero weights and 1.0 scales" if full < tp else ""
    return (
        f"--moe-backend {backend}: vLLM pads the experts' per-rank intermediate size {ip} to whole FP8 blocks "
        f"({alloc}): rank r holds rows [{alloc}r, {alloc}(r+1)) of {inter}{empty}. The serve line pins the "
        "backend (auto or triton would refine the scale grid instead: another layout). Cost: the padded "
        "ranks' MoE compute is wasted; auto's refined layout keeps every rank busy"
    )


# ---- MXFP4 experts (gpt-oss) ---------------------------------------------------------------------
# oracle/mxfp4.py mxfp4_round_up_hidden_size_and_intermediate_size, CUDA: what each backend named by
# --moe-backend (map_mxfp4_backend) rounds (hidden, per-rank intermediate) up to. `auto` picks by GPU
# (FlashInfer TRT-LLM on Blackwell: hidden 2880 -> 3072; Triton on Hopper), so reshard pins one.
MXFP4_ALIGN = {
    "triton": (1, 64),  # Mxfp4MoeBackend.TRITON: the `else` branch
    "marlin": (256, 128),
    "flashinfer_trtllm": (256, 128),
    "flashinfer_cutlass": (128, 128),
    "deep_gemm": (128, 128),
}


def mxfp4_backend(name: str) -> str:
    """The backend whose MXFP4 layout is written (`auto`: Triton, pinned)."""
    if name == "auto":
        return "triton"
    if name not in MXFP4_ALIGN:
        raise UnsupportedError(
            f"--moe-backend {name}: reshard does not write vLLM's MXFP4 expert layout for it "
            f"(not an MXFP4 backend in vLLM {VLLM_LAYOUT}, or its rounding depends on the GPU)",
            f"use one of {', '.join(MXFP4_ALIGN)}",
        )
    return name


def mxfp4_alloc(backend: str, hidden: int, ip: int) -> tuple[int, int]:
    """(hidden, per-rank intermediate) that `backend` makes GptOssMxfp4MoEMethod allocate."""
    h, i = MXFP4_ALIGN[backend]
    return -(-hidden // h) * h, -(-ip // i) * i


def mxfp4_pin_note(ip: int, alloc: int, hidden: int) -> str:
    return (
        f"serve line pins --moe-backend triton: vLLM's MXFP4 expert layout depends on the backend `auto` picks "
        f"(FlashInfer TRT-LLM on Blackwell pads the hidden size to a multiple of 256); this output is Triton's "
        f"(per-rank intermediate {ip} allocated as {alloc}, hidden {hidden}), which runs on Hopper and Blackwell"
    )


# ---- NVFP4 experts (issue 26) -----------------------------------------------------------------------
# oracle/nvfp4.py map_nvfp4_backend: the --moe-backend names vLLM runs NVFP4 experts with, and whether the
# backend is one of FLASHINFER_NVFP4_MOE_BACKENDS (is_global_sf_supported_for_nvfp4_backend): then
# ModelOptNvFp4FusedMoE sizes w13/w2_input_scale by the GLOBAL expert count and loads every expert's
# input scales on every rank (routed_experts.py weight_loader, use_global_sf). compressed-tensors'
# NVFP4 experts size them by the local count whatever the backend.
NVFP4_BACKENDS = {
    "b12x": False,
    "cutlass": False,
    "flashinfer_trtllm": True,
    "flashinfer_cutlass": True,
    "flashinfer_cutedsl": True,  # batched activation format: FLASHINFER_CUTEDSL_BATCHED, also FlashInfer
    "flashinfer_moe_ep_cutedsl": False,
    "flashinfer_b12x": True,
    "marlin": False,
    "humming": False,
    "emulation": False,
}
# what `auto` writes for ModelOpt NVFP4 under EP: FlashInfer TRT-LLM's layout (global input scales), the
# backend vLLM's auto picks first on Blackwell, pinned in the serve line
NVFP4_AUTO_EP = "flashinfer_trtllm"


def nvfp4_backend(name: str) -> str:
    if name != "auto" and name not in NVFP4_BACKENDS:
        raise UnsupportedError(
            f"--moe-backend {name} does not run NVFP4 experts in vLLM {VLLM_LAYOUT}",
            f"use one of {', '.join(NVFP4_BACKENDS)}",
        )
    return name


def nvfp4_global_scales(name: str, ep: bool, *, a16: bool = False) -> tuple[bool, str | None]:
    """(ModelOpt NVFP4 expert input scales sized by the global expert count, backend `auto` must pin).

    `a16` (W4A16_NVFP4): no FlashInfer NVFP4 MoE kernel takes unquantized activations
    (`_supports_quant_scheme`), so vLLM runs them with a backend of the rank's own input scales."""
    nvfp4_backend(name)
    if a16 and NVFP4_BACKENDS.get(name):
        raise UnsupportedError(
            f"--moe-backend {name}: vLLM's FlashInfer NVFP4 MoE kernels take NVFP4 activations only, and this "
            "checkpoint is W4A16 (no input activations)",
            f"use one of {', '.join(b for b, glob in NVFP4_BACKENDS.items() if not glob)}, or auto",
        )
    if not ep or a16:
        return False, None  # every rank holds every expert: one layout
    if name == "auto":
        return NVFP4_BACKENDS[NVFP4_AUTO_EP], NVFP4_AUTO_EP
    return NVFP4_BACKENDS[name], None


def nvfp4_pin_note(pin: str) -> str:
    return (
        f"serve line pins --moe-backend {pin}: under --ep, ModelOpt NVFP4 experts' input scales hold every "
        "expert's on each rank with vLLM's FlashInfer MoE backends (what auto picks on Blackwell) and only the "
        f"rank's own with the others; this output is {pin}'s layout. For Hopper (Marlin) write it with "
        "--moe-backend marlin"
    )
