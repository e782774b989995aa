"""What every split rule needs to know while planning: the checkpoint, the layout, the model's sizes.

One `Context` per `build_plan`: it looks source tensors up (and remembers which were used, so that
strays can be refused), collects notes for the user, and holds the quantization scheme.
"""

from __future__ import annotations

import copy

from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.format import DTYPE_CODES, TensorInfo
from reshard.plan.geometry import Dims, divisors
from reshard.plan.kvscales import KV_PARAMS, kv_scale_sources
from reshard.plan.quant import Quant
from reshard.plan.quantconfig import quant_from_config
from reshard.rules import Architecture
from reshard.rules.spec import Tower


class Context:
    def __init__(
        self, ckpt: Checkpoint, arch: Architecture, *, tp: int, ep: bool, dtype: str, moe_backend: str = "auto"
    ) -> None:
        self.ckpt = ckpt
        self.config = merged_config(ckpt.config, arch)
        # where config.json holds the sizes read: "" (its top level), `text_config`, a tower's `vision_config`
        self.config_key = arch.text_config if isinstance(ckpt.config.get(arch.text_config or ""), dict) else ""
        self.arch = arch
        self.tp = tp
        self.ep = ep
        self.dtype = dtype  # the model's, safetensors code
        self.notes: list[str] = []
        self.moe_backend = moe_backend  # vLLM's --moe-backend (reshard.plan.backends)
        self.moe_pin: str | None = None  # what the serve line must pin, set by the experts
        self.used: set[str] = set()
        self.pieces = True  # False: the layout only, without the experts' weight pieces (build_plan)
        # vLLM (ModelConfig.maybe_untie_word_embeddings) unties a "tied" model whose checkpoint ships its
        # own lm_head, reading config.json's top level; the sharded loader does not, so the output config
        # must say so. The language model ties by its own config (`tie_in_text_config`) or the top level.
        merged = bool(self.config.get("tie_word_embeddings", arch.tie_default))
        top = ckpt.config.get("tie_word_embeddings")
        top_tie = merged if top is None else bool(top)
        untie = top_tie and any(n in ckpt.tensors for n in arch.hf_names(f"{arch.lm_head}.weight"))
        self.config_patch: dict = {"tie_word_embeddings": False} if untie else {}
        if untie:
            self.note(
                "config.json says tie_word_embeddings but the checkpoint has its own lm_head: "
                "written untied, and the copied config.json says tie_word_embeddings: false"
            )
        tie = (merged if arch.tie_in_text_config or not arch.text_config else top_tie) and not untie
        self.dims = dims_from_config(ckpt.config, arch, tie=tie)
        quant = quant_from_config(self.config)
        self.quant: Quant | None = quant.for_checkpoint(ckpt.tensors) if quant else None
        if self.quant:
            self.config_patch.update(self.quant.config_patch(ckpt.config))
            if dtype not in self.quant.act_dtypes:
                raise UnsupportedError(
                    f"--dtype {DTYPE_CODES[dtype]}: vLLM runs {self.quant.method} quantization in "
                    f"{' or '.join(DTYPE_CODES[d] for d in self.quant.act_dtypes)} only, and refuses to start "
                    "otherwise",
                    "use --dtype auto",
                )
        fp8 = self.quant is not None and self.quant.method == "fp8"
        # vLLM KV-cache parameter -> the checkpoint tensors vLLM loads into it
        self.kv_scales = kv_scale_sources(ckpt.tensors, fp8_config=fp8)

    # ---- the checkpoint (reshard.plan.geometry.Sources) ------------------------------------------

    def src(self, name: str, why: str) -> TensorInfo:
        names = self.arch.hf_names(name)  # rules name tensors after vLLM's modules
        name = next((n for n in names if n in self.ckpt.tensors), names[0])
        t = self.ckpt.tensors.get(name)
        if t is None:
            held = self.ckpt.manifest.source_tensors if self.ckpt.manifest is not None else None
            if held is not None and name in held:  # a reshard output read back: the original had it
                raise NotHeld(
                    f"this reshard output does not hold the original's {name!r} (vLLM's layout keeps one value "
                    f"for {why}, not each of its parts'), which this layout needs",
                    "re-shard (or merge) the original checkpoint",
                )
            raise SourceError(
                f"checkpoint lacks tensor {name!r} (needed for vLLM's {why})",
                "the checkpoint is incomplete or not of the architecture its config.json names",
            )
        self.used.add(name)
        return t

    def src_each(self, names: list[str]) -> list[TensorInfo] | None:
        """`src` of every name at once (an MoE layer's experts), marked used; None where one is
        missing or the architecture renames checkpoint names: then `src` them one by one."""
        if self.arch.hf_to_vllm.orig_to_new_prefix:
            return None
        found = list(map(self.ckpt.tensors.get, names))
        if not all(found):
            return None
        self.used.update(names)
        return found  # type: ignore[return-value]

    def mark_used(self, name: str) -> None:
        self.used.add(name)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ---- questions the rules ask -------------------------------------------------------------------

    def flag(self, value: bool | str) -> bool:
        """A module field that is a literal or the config key that says so."""
        return bool(self.config.get(value, False)) if isinstance(value, str) else value

    def quantized(self, hf_prefixes: list[str], *, experts: bool = False) -> bool:
        """The checkpoint's scheme applies to the modules at `hf_prefixes` (not on its ignore list)."""
        if not self.quant:
            return False
        names = [self.arch.hf_name(p) for p in hf_prefixes]
        return self.quant.quantizes(names, experts=experts)

    def quantized_experts(self, hf_prefix: str, names: tuple[str, str, str]) -> bool:
        """The checkpoint's scheme applies to the experts list at `hf_prefix` (its experts' projections `names`)."""
        if not self.quant:
            return False
        return self.quant.quantizes_experts(self.arch.hf_name(hf_prefix), names)

    def kv_found(self, target: str) -> dict[str, str]:
        """The attention layer `target`'s KV-cache parameters the checkpoint holds a tensor for."""
        found = {}
        for param in KV_PARAMS:
            names = self.kv_scales.get(f"{target}.{param}", [])
            if len(names) > 1:
                raise UnsupportedError(
                    f"{len(names)} checkpoint tensors are vLLM's {target}.{param}: {', '.join(names)}",
                    "vLLM keeps whichever it reads last; keep one of them in the checkpoint",
                )
            if names:
                found[param] = names[0]
        return found

    def tower(self, tower: Tower, tp: int) -> Context:
        """This context for a multimodal encoder: its settings and sizes, `tp` ranks (1: whole on every
        rank, --mm-encoder-tp-mode data); the checkpoint, used tensors, notes and quantization shared."""
        sub = copy.copy(self)
        sub.config = tower.settings(self.ckpt.config)
        sub.config_key = tower.config

        def need(key: str) -> int:
            value = sub.config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SourceError(f"config.json lacks {tower.config}.{key}, which {self.arch.names[0]} needs")
            return value

        heads = need(tower.heads)
        sub.dims = Dims(need(tower.hidden), 0, heads, heads, 0, False)  # its blocks: tower.blocks
        sub.tp = tp
        return sub

    def split(self, size: int, what: str) -> int:
        """`size` / tp, refused when it does not divide."""
        if size % self.tp:
            raise UnsupportedError(
                f"{what} = {size} is not divisible by --tp {self.tp}",
                f"use a --tp that divides it: {divisors(size)}",
            )
        return size // self.tp


def merged_config(config: dict, arch: Architecture) -> dict:
    """config.json as the rules read it: a multimodal model's text config over the top level."""
    if arch.text_config and not isinstance(config.get(arch.text_config), dict) and "hidden_size" not in config:
        raise SourceError(f"config.json lacks {arch.text_config!r}, which {arch.names[0]} needs")
    return arch.text(config)


class NotHeld(SourceError):
    """A tensor of the original that a reshard output read back does not hold (vLLM's layout kept one value
    of a fused module's parts): a missing tensor to the rules that probe for optional ones, and told as
    a layout this output cannot give (exit 3) where planning needs it (`build_plan`)."""


def dims_from_config(config: dict, arch: Architecture, *, tie: bool | None = None) -> Dims:
    """The model's sizes from config.json; `tie`: whether vLLM ties its lm_head (default: what the config
    the rules read says)."""
    config = merged_config(config, arch)

    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise SourceError(f"config.json lacks {key!r}, which {arch.names[0]} needs")
        return int(config[key])

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    return Dims(
        hidden=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab=need("vocab_size"),
        tie=bool(config.get("tie_word_embeddings", arch.tie_default)) if tie is None else tie,
        num_experts=next((int(config[k]) for k in arch.experts_key if config.get(k)), 0) if arch.moe_mlp else 0,
        moe_intermediate=int(config.get(arch.moe_intermediate_key) or 0) if arch.moe_mlp else 0,
    )
