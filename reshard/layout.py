"""The layout a folder is for, as one frozen value: what the vLLM engine that loads it must be run with.

Asked for on the command line (`--tp`, `--pp`, `--ep`, `--dtype`, `--pp-layer-partition`,
`--moe-backend`: reshard.commands.options), resolved by the planner against the checkpoint (the
dtype, the layers of each stage, the quantization, the MoE backend the serve line must pin), written
to and parsed from `reshard.json` only by reshard.manifest, and compared as is by verify, the vLLM
plugin, the torchrun run id and the tests. Defaults live at the CLI edge; this module only checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# --dtype: torch's names; "auto" is config.json's torch_dtype, resolved by the planner
DTYPES = ("auto", "bfloat16", "float16", "float32")
# --platform: the vLLM platform whose model class names the keys (DeepSeek-V3.2 / GLM-5: issue 27)
PLATFORMS = ("cuda", "rocm", "cpu")
# vLLM's --mm-encoder-tp-mode
MM_ENCODER_TP_MODES = ("weights", "data")


@dataclass(frozen=True, slots=True)
class Layout:
    """tp/pp/ep: vLLM's --tensor-parallel-size, --pipeline-parallel-size, --enable-expert-parallel.

    dtype: the model dtype in torch's name (`auto` until planned).
    partition: layers per pipeline stage (VLLM_PP_LAYER_PARTITION); None until planned means vLLM's
        default split.
    moe_backend: vLLM's --moe-backend the experts are laid out for.
    moe_pin: the --moe-backend the serve line must name because the layout depends on it (planned).
    quantization: the checkpoint's quantization record as the manifest holds it (planned), or None.
    platform: the vLLM platform the folder's key names are for, where they depend on it (DeepSeek-V3.2's
        CUDA, ROCm and CPU classes name the same parameters differently); None where they do not
        (planned: the planner keeps it only for such architectures).
    mm_encoder_tp_mode: vLLM's --mm-encoder-tp-mode for a multimodal model's encoder: "weights" (its
        linear layers TP-sharded) or "data" (whole on every rank); None: no encoder in the folder
        (planned: a text-only model, or --language-model-only).
    language_model_only: vLLM's --language-model-only: a multimodal model written without its encoder.
    """

    tp: int = 1
    pp: int = 1
    ep: bool = False
    dtype: str = "auto"
    partition: tuple[int, ...] | None = None
    moe_backend: str = "auto"
    moe_pin: str | None = None
    quantization: dict | None = field(default=None, compare=True, hash=False)
    platform: str | None = None
    mm_encoder_tp_mode: str | None = None
    language_model_only: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, not {value!r}")
        if not isinstance(self.ep, bool):
            raise ValueError(f"ep must be true or false, not {self.ep!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.partition is not None and (
            not isinstance(self.partition, tuple) or not all(type(n) is int and n >= 1 for n in self.partition)
        ):
            raise ValueError(f"partition must be positive layer counts, not {self.partition!r}")
        if not isinstance(self.moe_backend, str) or (self.moe_pin is not None and not isinstance(self.moe_pin, str)):
            raise ValueError(f"moe_backend must be a name, not {self.moe_backend!r} / {self.moe_pin!r}")
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, not {self.platform!r}")
        if self.mm_encoder_tp_mode not in (*MM_ENCODER_TP_MODES, None):
            raise ValueError(f"mm_encoder_tp_mode must be weights, data or null, not {self.mm_encoder_tp_mode!r}")
        if not isinstance(self.language_model_only, bool):
            raise ValueError(f"language_model_only must be true or false, not {self.language_model_only!r}")
        if self.quantization is not None and not isinstance(self.quantization, dict):
            raise ValueError(f"quantization must be an object or null, not {self.quantization!r}")

    @property
    def world(self) -> int:
        """How many engine ranks (processes, GPUs) load the folder."""
        return self.tp * self.pp

    def engine_rank(self, pp_rank: int, tp_rank: int) -> int:
        """vLLM's global rank of (pp_rank, tp_rank): pp_rank * tp + tp_rank (`save --ranks` numbers)."""
        return pp_rank * self.tp + tp_rank

    def serve_env(self) -> tuple[str, ...]:
        """The environment `vllm serve` needs for this layout: a layer partition other than vLLM's
        default split (VLLM_PP_LAYER_PARTITION; without it vLLM splits as `default_partition`)."""
        part = self.partition
        if self.pp > 1 and part is not None and part != default_partition(sum(part), self.pp):
            return (f"VLLM_PP_LAYER_PARTITION={','.join(map(str, part))}",)
        return ()

    def mm_flags(self) -> tuple[str, ...]:
        """The `vllm serve` options the encoder's layout needs (pinned even where vLLM's default)."""
        if self.language_model_only:
            return ("--language-model-only",)
        return (f"--mm-encoder-tp-mode {self.mm_encoder_tp_mode}",) if self.mm_encoder_tp_mode else ()

    def same_ranks(self, other: Layout) -> bool:
        """Both split the model over the same ranks the same way (tp, pp, ep)."""
        return (self.tp, self.pp, self.ep) == (other.tp, other.pp, other.ep)

    def tag(self) -> str:
        """The short form each rank file's safetensors metadata records (`reshard_layout`)."""
        return f"tp={self.tp},pp={self.pp},ep={int(self.ep)}"

    def but(self, **changes: object) -> Layout:
        """A copy with `changes` (checked like a new one)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={'on' if self.ep else 'off'}"


def default_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's split of `num_layers` over `pp` stages without VLLM_PP_LAYER_PARTITION (get_pp_indices,
    distributed/utils.py): even, the extra layers to the stages before the last, backwards."""
    sizes = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        sizes[-2 - i] += 1
    return tuple(sizes)
