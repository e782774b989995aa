"""What the vLLM harness patches so CPU vLLM 0.32 builds the layouts a GPU would: only kernel and backend
*selection* (vLLM CPU has no FP8 / NVFP4 / WNA16 / INT8 MoE kernels, no sparse attention) and the values
of parameters vLLM allocates with torch.empty and never loads. Every layout decision stays vLLM's own code
(create_weights, weight loaders, the backends' rounding)."""

from __future__ import annotations

from pathlib import Path


def force_moe_backend(name: str) -> None:
    """Build the experts as vLLM does on a GPU where `--moe-backend name` is usable.

    vLLM picks the layout (refine or pad the FP8 block grid: ``Fp8MoEMethod.__init__`` ->
    ``resolve_fp8_moe_weight_block_shape``; round the unquantized per-rank size up:
    ``UnquantizedFusedMoEMethod.maybe_roundup_sizes``) from ``moe_backend`` and from the backend
    its oracle selects; on this CPU the oracle refuses every GPU backend, so the selection (only)
    is replaced by the named backend. Every layout decision stays vLLM's own code.
    """
    if name == "auto":
        return
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as u_oracle
    from vllm.model_executor.layers.quantization import fp8

    fp8.select_fp8_moe_backend = lambda config, *a, **k: (fp8_oracle.map_fp8_backend(config.moe_backend), None)
    # gpt-oss MXFP4 (GptOssMxfp4MoEMethod.__init__): maybe_roundup_sizes then rounds for that backend
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as mxfp4_oracle
    from vllm.model_executor.layers.quantization import mxfp4

    mxfp4.select_mxfp4_moe_backend = lambda config, *a, **k: (
        mxfp4_oracle.map_mxfp4_backend(config.moe_backend)[0],
        None,
    )
    um.select_unquantized_moe_backend = lambda moe_config: (
        u_oracle.map_unquantized_backend(moe_config.moe_backend),
        None,
    )


def _or_unbuilt(choose):
    """vLLM's mixed-precision kernel choice `choose`, falling back (where it finds none on this CPU) to a
    kernel that builds and loads the layer and is never run: the parameters do not depend on the kernel."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel

    class Unbuilt(MPLinearKernel):  # the layer is built and loaded, never run
        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @classmethod
        def can_implement(cls, c):
            return True, None

        def process_weights_after_loading(self, layer) -> None:
            raise NotImplementedError("no CPU kernel for this layer")

        def apply_weights(self, layer, x, bias=None):
            raise NotImplementedError("no CPU kernel for this layer")

    def chosen(*a, **k):
        try:
            return choose(*a, **k)
        except ValueError:
            return Unbuilt

    return chosen


def allow_gptq() -> None:
    """issue 26: let GPTQ / AWQ layers be *built* on this CPU. Only kernel checks are relaxed: Marlin's
    platform check for 8-bit GPTQ linears (``verify_marlin_supported``: CPU vLLM builds 4-bit only), and
    the experts' kernel choice (no CPU WNA16 MoE kernel takes these tiny shapes: Marlin's, as a CUDA GPU
    picks). The parameters (``create_weights``) and loaders stay vLLM's; the Marlin-or-MoeWNA16 layout
    choice (``check_moe_marlin_supports_layer``) is not patched. 8-bit linears get a kernel that is never
    run (no CPU kernel takes uint8b128; the parameters do not depend on it)."""
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization import auto_awq, auto_gptq

    # 8-bit GPTQ: CPU vLLM has no linear kernel for uint8b128
    auto_gptq.choose_mp_linear_kernel = _or_unbuilt(auto_gptq.choose_mp_linear_kernel)
    auto_gptq.verify_marlin_supported = lambda *a, **k: None
    select = auto_gptq.select_wna16_moe_backend

    def selected(*a, **k):
        try:
            return select(*a, **k)
        except (ValueError, NotImplementedError):
            return WNA16MoEBackend.MARLIN, None

    auto_gptq.select_wna16_moe_backend = selected
    from vllm.model_executor.layers.quantization import moe_wna16

    moe_wna16.select_wna16_moe_backend = selected  # the fallback layout's kernel, likewise
    if hasattr(auto_awq, "select_wna16_moe_backend"):
        auto_awq.select_wna16_moe_backend = selected


def allow_wna16_moe() -> None:
    """Let compressed-tensors integer experts be *built* on this CPU: vLLM CPU has no WNA16 MoE kernel
    ("No WNA16 MoE backend supports the deployment configuration") and may have no INT8 one, so where
    its oracle finds none the selection (only) falls back to the backend a CUDA GPU picks (Marlin,
    Triton). The experts' parameters do not depend on the backend (WNA16: N-first,
    ``CompressedTensorsWNA16MoEMethod.get_weight_shape``): layouts and loaders stay vLLM's own code."""
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    def fallback(select, backend):
        def selected(*a, **k):
            try:
                return select(*a, **k)
            except (ValueError, NotImplementedError):
                return backend, None

        return selected

    wna16.select_wna16_moe_backend = fallback(wna16.select_wna16_moe_backend, WNA16MoEBackend.MARLIN)
    # Marlin's tile-size check (the tiny models' hidden size is below its tile): a kernel's limit, not the layout's
    wna16.check_moe_marlin_supports_config = lambda *a, **k: True
    int8.select_int8_moe_backend = fallback(int8.select_int8_moe_backend, Int8MoeBackend.TRITON)
    allow_small_wna16_linear()  # issue 26: other MoE families


def allow_small_wna16_linear() -> None:
    """issue 26 (other MoE families): let a compressed-tensors WNA16 linear whose per-rank input is below what
    vLLM CPU's kernel takes (CPUWNA16: multiples of 32; the tiny GLM-4.5's shared-expert down_proj has 16 at
    TP 2) be *built*. Only the kernel choice falls back, to one that is never run: the parameters
    (CompressedTensorsWNA16.create_weights) do not depend on it (Marlin changes only the activation dtype)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16 as ct

    ct.choose_mp_linear_kernel = _or_unbuilt(ct.choose_mp_linear_kernel)


# ---- issue 26: NVFP4 --------------------------------------------------------------------------------
class NoNvfp4Kernel:
    """Stand-in for the NVFP4 GEMM kernel vLLM CPU has none of: create_weights asks it only for the
    input quant key it would expose (none); running or post-processing with it fails."""

    def input_quant_key(self):
        return None

    def __getattr__(self, name):
        raise RuntimeError("no NVFP4 linear kernel on this machine")


def allow_nvfp4(moe_backend: str) -> None:
    """Let NVFP4 checkpoints (compressed-tensors and ModelOpt) be *built* on this CPU: vLLM CPU has no
    NVFP4 linear kernel ("Failed to find a kernel that can implement the NVFP4 linear layer") and no
    NVFP4 MoE backend. The linear layout does not depend on the kernel; the experts' does only for
    ModelOpt under EP (FlashInfer backends: input scales of every expert), so the MoE selection returns
    the backend `--moe-backend` names (auto: Marlin, what a GPU without FlashInfer picks). Only the
    selection is replaced: create_weights and the loaders stay vLLM's code."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as oracle
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as ct_linear,
    )

    def linear_kernel(*a, **k):
        return NoNvfp4Kernel()

    def moe_backend_of(config, *a, **k):
        if config.moe_backend == "auto":
            return oracle.NvFp4MoeBackend.MARLIN, None
        return oracle.map_nvfp4_backend(config.moe_backend), None

    ct_linear.init_nvfp4_linear_kernel = linear_kernel
    modelopt.init_nvfp4_linear_kernel = linear_kernel
    ct_moe.select_nvfp4_moe_backend = moe_backend_of
    modelopt.select_nvfp4_moe_backend = moe_backend_of
    del moe_backend


def fill_unread_nvfp4_input_scales(model) -> None:
    """NVFP4 experts without input activations (A16) register their input scales with ``torch.empty``
    and vLLM never loads nor reads them: their bytes are whatever memory held. A sharded_state folder
    holds 1.0 there (reshard.plan.nvfp4.UNREAD); the comparison sets vLLM's to the same value first."""
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        nvfp4 = "Nvfp4" in type(qm).__name__ or "NvFp4" in type(qm).__name__
        if nvfp4 and getattr(qm, "use_a16", False):
            for name in ("w13_input_global_scale", "w2_input_global_scale", "w13_input_scale", "w2_input_scale"):
                p = getattr(m, name, None)
                if p is not None:
                    p.data.fill_(1.0)


# issue 27: DSA (DeepSeek-V3.2 / GLM-5)
def allow_sparse_mla_build() -> None:
    """Let DeepSeek-V3.2's sparse MLA be *built* on this CPU: vLLM CPU refuses to select an attention
    backend for it ("Sparse Attention is not supported on CPU.", platforms/cpu.py), so the selection
    (only) falls back to XPU's sparse MLA backend, the one vLLM picks for the same generic class on
    XPU. Backends hold no parameters: the state is the model code's. It cannot run here (no GEN case)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = type(current_platform)
    select = cls.get_attn_backend_cls

    def selected(selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return AttentionBackendEnum.XPU_MLA_SPARSE.get_path()
        return select(selected_backend, attn_selector_config, num_heads)

    cls.get_attn_backend_cls = staticmethod(selected)


def zero_moe_padding(model) -> None:
    """What vLLM's post-processing does first to a rounded-up unquantized expert allocation
    (``convert_to_unquantized_kernel_format`` -> ``_zero_intermediate_padding``): the parameters are
    ``torch.empty`` and the loader writes only the checkpoint's rows, so the padding holds whatever
    memory held until then. The padding is zero in a sharded_state folder."""
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as u_oracle

    for m in model.modules():
        backend = getattr(getattr(m, "quant_method", None), "unquantized_backend", None)
        if backend in (u_oracle.UnquantizedMoeBackend.FLASHINFER_TRTLLM, u_oracle.UnquantizedMoeBackend.AITER):
            u_oracle._zero_intermediate_padding(m.moe_config, m.w13_weight.data, m.w2_weight.data)


class NoFp8Kernel:
    """Stand-in for an FP8 GEMM kernel this CPU cannot run (see below)."""

    def __init__(self, reason: str):
        self.reason = reason

    def input_quant_key(self):
        """Asked while building (ModelOpt's linear: vllm fusion.quant_activation.expose_input_quant_key),
        for fusion only: None is "the kernel quantizes its own input", which adds no attribute."""
        return None

    def __getattr__(self, name):
        raise RuntimeError(f"no FP8 linear kernel on this machine: {self.reason}")


def allow_missing_fp8_linear_kernel(dump_dir: Path) -> None:
    """Let FP8 checkpoints be *built* on CPUs without AMX.

    ``Fp8LinearMethod.create_weights`` registers ``weight``/``weight_scale_inv``
    first and only then picks a GEMM kernel (``init_fp8_linear_kernel``); on a
    CPU without AMX tiles (e.g. AMD EPYC) every CPU FP8 kernel refuses and model
    construction raises.  The kernel only matters for running and for
    post-processing, neither of which this harness does, so fall back to a
    stand-in that fails if it is ever used.  The fallback is logged in
    ``<dump_dir>/fp8-kernel-fallback.txt``.
    """
    import importlib

    from vllm.model_executor.layers.quantization import fp8

    orig = fp8.init_fp8_linear_kernel
    if getattr(orig, "_reshard_patched", False):
        return

    def init_fp8_linear_kernel(*args, **kwargs):
        try:
            return orig(*args, **kwargs)
        except ValueError as e:
            if "Failed to find a kernel" not in str(e):
                raise
            reason = str(e).replace("\n", " ")
            (dump_dir / "fp8-kernel-fallback.txt").write_text(reason + "\n")
            return NoFp8Kernel(reason)

    init_fp8_linear_kernel._reshard_patched = True  # type: ignore[attr-defined]
    # every scheme that picks an FP8 GEMM kernel while building imported the function by name
    # (ModelOpt's FP8_PB_WO block linear picks the block-scaled kernel, which needs AMX too)
    for name in _FP8_KERNEL_USERS:
        module = importlib.import_module(name)
        if getattr(module, "init_fp8_linear_kernel", None) is orig:
            module.init_fp8_linear_kernel = init_fp8_linear_kernel


_FP8_KERNEL_USERS = (
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.fbgemm_fp8",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8",
)
