"""An architecture's split rules as data: its table of styles (reshard.rules.styles) and the names
vLLM gives its checkpoint's tensors (vLLM's `WeightsMapper`, in its own terms).

Nothing here knows about bytes or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from reshard.rules.styles import Rule

ShardId = int | str | tuple[int, ...]
_QKV_IDS = {"q": 0, "k": 1, "v": 2}


@dataclass(frozen=True, eq=False)
class WeightsMapper:
    """The part of vLLM's `WeightsMapper` (model_executor/models/utils.py) that reshard needs, with its
    field names, so that a table holds the very dicts of the model's `hf_to_vllm_mapper`.

    Attributes:
        orig_to_new_stacked: checkpoint weight name -> (vLLM parameter name, shard id): the slots of
            fused modules (`".q_proj": (".qkv_proj", "q")`). A tuple shard id says one checkpoint
            tensor holds consecutive slots (Qwen3.5's `".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2))`).
        orig_to_new_prefix: checkpoint prefix -> vLLM prefix, where the two differ
            (`"model.language_model.": "language_model.model."`).
    """

    orig_to_new_stacked: Mapping[str, tuple[str, ShardId]] = field(default_factory=dict)
    orig_to_new_prefix: Mapping[str, str] = field(default_factory=dict)

    def __or__(self, other: WeightsMapper) -> WeightsMapper:
        """Both mappings, `other` winning (as vLLM's `WeightsMapper.__or__`)."""
        return WeightsMapper(
            {**self.orig_to_new_stacked, **other.orig_to_new_stacked},
            {**self.orig_to_new_prefix, **other.orig_to_new_prefix},
        )

    def shards(self, fused: str) -> tuple[str, ...]:
        """The checkpoint names of fused module `fused`'s slots, in shard order (a tuple shard id
        repeats its tensor once per slot); () when none is stacked into it."""
        full = "." + fused
        found: list[tuple[int, str]] = []
        for weight, (param, shard_id) in self.orig_to_new_stacked.items():
            param = param if param.startswith(".") else "." + param
            if not full.endswith(param):
                continue
            name = (full[: -len(param)] + (weight if weight.startswith(".") else "." + weight))[1:]
            ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
            found += [(_QKV_IDS[i] if isinstance(i, str) else i, name) for i in ids]
        found.sort()
        if [i for i, _ in found] != list(range(len(found))):
            raise AssertionError(f"{fused}: stacked shard ids {[i for i, _ in found]} are not 0..n-1")
        return tuple(name for _, name in found)

    def hf_name(self, name: str) -> str:
        """The checkpoint's name of a tensor named after vLLM's module path (the prefixes inverted)."""
        return self.hf_names(name)[0]

    def hf_names(self, name: str) -> tuple[str, ...]:
        """Every checkpoint name vLLM maps to `name`, the first prefix's first (Qwen2.5-VL's releases
        say `model.layers.`, newer exports `model.language_model.layers.`; both are its
        `language_model.model.layers.`), and `name` itself where no prefix would rename it."""
        prefixes = self.orig_to_new_prefix
        if not prefixes:
            return (name,)  # nothing renamed (most text models): the one name, at once
        found = [orig + name[len(new) :] for orig, new in prefixes.items() if name.startswith(new)]
        if not any(name.startswith(orig) for orig in prefixes):
            found.append(name)  # vLLM keeps a name no prefix of its mapper matches (Qwen2.5-VL's `visual.`)
        return tuple(dict.fromkeys(found))


def stacked_params_mapping(rows: Iterable[tuple[str, str, ShardId]]) -> dict[str, tuple[str, ShardId]]:
    """A model's `stacked_params_mapping` list in its `load_weights` ((param_name, shard_name, shard_id),
    the older spelling) as `orig_to_new_stacked`."""
    return {shard: (param, shard_id) for param, shard, shard_id in rows}


@dataclass(frozen=True, eq=False)
class Mixers:
    """Hybrid models' token mixers (Qwen3-Next's `linear_attention` / `full_attention`): per layer type,
    the modules that follow the table's `layer` ones in a decoder layer, chosen by
    `layer_type(config, layer)`."""

    layer_type: Callable[[dict, int], str]
    by_type: Mapping[str, tuple[Rule, ...]]

    def of(self, config: dict, layer: int) -> tuple[Rule, ...]:
        return self.by_type[self.layer_type(config, layer)]


@dataclass(frozen=True)
class Blocks:
    """A list of like modules of an encoder (its transformer blocks, Qwen3-VL's deepstack mergers).

    Attributes:
        prefix: where item `{layer}`'s modules live (vLLM's path from the model root).
        rules: the modules of every item.
        count: the config key (of the encoder's settings) of how many there are, or a function of them.
    """

    prefix: str
    rules: tuple[Rule, ...]
    count: str | Callable[[dict], int]

    def number(self, config: dict) -> int:
        return int(self.count(config) if callable(self.count) else config.get(self.count) or 0)


@dataclass(frozen=True)
class Choice:
    """An encoder setting of which only some values are built: vLLM's model raises on another
    (`NotImplementedError`, even under --language-model-only, where it still constructs the encoder), or
    reshard's table has no rule for it (`by="reshard"`: refused only where the encoder is written).

    Attributes:
        key: the setting (in the encoder's config, its `Tower.defaults` applied).
        values: the values built.
        by: who cannot build another value: "vLLM" or "reshard".
        same_as: another setting whose value is accepted too (Kimi's `qkv_hidden_size` equal to `hidden_size`).
    """

    key: str
    values: tuple[object, ...]
    by: str = "vLLM"
    same_as: str | None = None

    def accepts(self, settings: dict) -> bool:
        value = settings.get(self.key)
        if self.same_as is not None and value == settings.get(self.same_as):
            return True
        return any(value == v and type(value) is type(v) for v in self.values)


@dataclass(frozen=True)
class Tower:
    """A multimodal model's encoder (vision tower and its projector/merger), planned with its own sizes.

    vLLM builds it on every rank, its linear layers TP-sharded (`--mm-encoder-tp-mode weights`, the
    default) or whole on every rank (`data`: `disable_tp`), and not at all under `--language-model-only`.

    Attributes:
        config: the config.json key of the tower's settings (`vision_config`); its `heads` and
            `hidden` keys are the tower's head count and width.
        top: modules outside the blocks (patch embedding, merger), vLLM paths from the model root.
        blocks: its lists of like modules (`Blocks`).
        skip: checkpoint tensor-name prefixes of the tower, left out under --language-model-only.
        data_mode: vLLM's model supports `--mm-encoder-tp-mode data` (`supports_encoder_tp_data`);
            where not, vLLM falls back to weights.
        split_in_data_mode: vLLM splits it across the TP ranks in data mode too (Llama-4's projector,
            built without `disable_tp`).
        device_normalize: vLLM's model normalises images on the device (`supports_mm_device_do_normalize`,
            Qwen-VL): with the default `--mm-device-do-normalize` and a real preprocessor_config.json,
            vLLM 0.32 registers `input_norm.weight`/`.bias` buffers in the state dict that 0.33 does not
            (non-persistent there); the serve line pins `--no-mm-device-do-normalize`, the same model in both.
        heads_fallback: where `heads` does not divide the TP size, vLLM builds the encoder whole on every
            rank, as in data mode (`is_vit_use_data_parallel(num_heads)`, Kimi-K2.5's MoonViT), instead of
            failing to build.
        unquantized_with: quantization methods (reshard's `Quant.method`) under which vLLM builds the encoder
            without the quant config whatever its ignore list says (Kimi-K2.5's `_maybe_ignore_quant_config`:
            compressed-tensors); under other methods its layers must be on the ignore list.
        defaults: values of the encoder's settings where config.json leaves them out (the transformers
            config class's defaults vLLM builds from, or the model's own `getattr` defaults), as (key, value)
            pairs.
        choices: settings of which only some values are built (`Choice`); another is refused (exit 3).
    """

    config: str
    top: tuple[Rule, ...]
    blocks: tuple[Blocks, ...]
    skip: tuple[str, ...]
    heads: str = "num_heads"
    hidden: str = "hidden_size"
    data_mode: bool = True
    split_in_data_mode: bool = False
    device_normalize: bool = False
    heads_fallback: bool = False
    unquantized_with: tuple[str, ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()
    choices: tuple[Choice, ...] = ()

    def settings(self, config: dict) -> dict:
        inner = config.get(self.config)
        return {**dict(self.defaults), **(inner if isinstance(inner, dict) else {})}


@dataclass(frozen=True)
class Architecture:
    """Split rules of one model family, as data.

    Attributes:
        names: the `architectures` values of config.json it covers.
        top: modules outside the decoder layers (embedding, final norm, lm_head).
        layer: modules of every decoder layer, under `layer_prefix`.
        hf_to_vllm: vLLM's `hf_to_vllm_mapper` (or `stacked_params_mapping`) of the model: the
            checkpoint names of fused modules' slots, and prefixes that differ from vLLM's.
        layer_prefix: where decoder layer L's modules live, in vLLM and in the checkpoint
            (`{layer}` is replaced by L).
        embedding: the top module that is the input embedding: with pipeline parallelism it is
            on the first stage (and on the last when the lm_head is tied to it); the other top
            modules are on the last stage (unless top_on_every_stage).
        lm_head: the HF module of the output projection; a "tied" checkpoint that still ships
            its weight is written untied (as vLLM loads it), a tied one's stray copy is skipped.
        dense_mlp: the MLP of a dense layer.
        moe_mlp: the MLP of a mixture-of-experts layer.
        is_moe_layer: which layers use `moe_mlp` (config, layer index) -> bool.
        ignore: HF tensor-name suffixes that vLLM skips (e.g. rotary inv_freq).
        experts_key / moe_intermediate_key: config keys of the expert count (first found) and
            of the expert width.
        top_on_every_stage: with pipeline parallelism, every top module on every stage.
        spec_layers_key: config keys (first found) of the number of speculative (MTP) layers
            stored after the decoder layers, `model.layers.{num_hidden_layers + i}.*`, which
            vLLM's main model skips (DeepSeek-V3's num_nextn_predict_layers).
        mixers: hybrid models' token mixers by layer type, after `layer` and before the MLP.
        every_stage: top modules vLLM builds on every pipeline stage (unconditionally), whatever
            `embedding`/`top_on_every_stage` say of the others.
        skip_prefixes: checkpoint tensor-name prefixes vLLM's model does not load (`mtp.`: the
            draft model's; `model.visual.`: a vision tower not built under --language-model-only,
            which `serve_flags` then carries).
        text_config: the config.json key whose dict holds the language model's settings (vLLM's
            hf_text_config, e.g. Llama-4's and Qwen3.5's `text_config`); its keys override the top
            level's (quantization_config stays top-level).
        serve_flags: `vllm serve` options the layout needs (--language-model-only).
        tie_default: tie_word_embeddings where config.json does not say (transformers' default for
            the model's config class: True for Gemma-3's, whose releases leave it out).
        tie_in_text_config: a model with `text_config` whose language model reads tie_word_embeddings there
            (vLLM's Qwen3.5 classes build it from hf_text_config). Otherwise the top level's decides, as vLLM's
            `with_hf_config` copies it into the text config of the multimodal models built through it.
        towers: multimodal encoders vLLM builds beside the language model (`Tower`); none: a text
            model, or (with `--language-model-only` in serve_flags) a tower without rules, always
            left out.
        moe_on_every_stage: vLLM's model class fails to build a pipeline stage that holds no MoE
            layer ("No ... layer found in model.layers", its MixtureOfExperts set-up).
        fused_late: modules (their vLLM names' last part) the model registers as fused only after its
            quantization config copied the mapping (SupportsQuant.__new__ runs before __init__ adds them:
            Qwen3-MoE's dense `gate_up_proj`). In a fresh vLLM process the quantization of such a module
            is decided by its fused name alone, not its checkpoint slots'; where the two disagree, vLLM
            builds it otherwise than the checkpoint stores it, and the checkpoint is refused.
    """

    names: tuple[str, ...]
    top: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    hf_to_vllm: WeightsMapper = WeightsMapper()
    dense_mlp: tuple[Rule, ...] = ()
    moe_mlp: tuple[Rule, ...] = ()
    is_moe_layer: Callable[[dict, int], bool] | None = None
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",)
    experts_key: tuple[str, ...] = ("num_experts", "num_local_experts")
    moe_intermediate_key: str = "moe_intermediate_size"
    top_on_every_stage: bool = False
    spec_layers_key: tuple[str, ...] = ()
    layer_prefix: str = "model.layers.{layer}."
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    mixers: Mixers | None = None
    every_stage: tuple[str, ...] = ()
    skip_prefixes: tuple[str, ...] = ()
    text_config: str | None = None
    serve_flags: tuple[str, ...] = ()
    towers: tuple[Tower, ...] = ()
    tie_default: bool = False
    tie_in_text_config: bool = False
    moe_on_every_stage: bool = False
    fused_late: tuple[str, ...] = ()

    def text(self, config: dict) -> dict:
        """The settings of the language model: config.json, or its text_config over it."""
        inner = config.get(self.text_config) if self.text_config else None
        return {**config, **inner} if isinstance(inner, dict) else config

    def layer_modules(self, config: dict, layer: int) -> tuple[Rule, ...]:
        """Decoder layer `layer`'s modules before its MLP: the common ones, then its mixer's."""
        return self.layer + self.mixers.of(config, layer) if self.mixers else self.layer

    def hf_name(self, name: str) -> str:
        """The checkpoint's name of a tensor named after vLLM's module path."""
        return self.hf_to_vllm.hf_name(name)

    def hf_names(self, name: str) -> tuple[str, ...]:
        """Every checkpoint name vLLM maps to `name` (WeightsMapper.hf_names)."""
        return self.hf_to_vllm.hf_names(name)

    @property
    def text_only(self) -> bool:
        """A multimodal model written --language-model-only by default (its tower only when a
        --mm-encoder-tp-mode is asked, where `towers` has its rules: Llama-4, Qwen3.5-MoE)."""
        return "--language-model-only" in self.serve_flags

    def shards(self, fused: str) -> tuple[str, ...]:
        """The checkpoint names of fused module `fused`'s slots (WeightsMapper.shards)."""
        return self.hf_to_vllm.shards(fused)

    def prefix(self, layer: int) -> str:
        """Decoder layer `layer`'s prefix (speculative layers after the last included)."""
        return self.layer_prefix.format(layer=layer)

    def layer_of(self, tensor: str) -> int | None:
        """The decoder layer a checkpoint tensor belongs to, or None (embedding, final norm, ...)."""
        head, _, tail = self.layer_prefix.partition("{layer}")
        if not tensor.startswith(head):
            return None
        number = tensor[len(head) :].split(tail, 1)[0] if tail else tensor[len(head) :]
        return int(number) if number.isdigit() else None
