"""The vLLM model loader behind `--load-format reshard` (imported only by vLLM, through `register`).

Before a tensor byte is read, on every rank: the manifest must fit the engine (tp, pp, ep, dtype,
quantization, pinned MoE backend, vLLM range), the rank's files must be there with the recorded sizes,
headers and run, and the model's `state_dict()` after vLLM's own alias filtering must equal the rank's
recorded tensors (keys, dtypes, shapes; LoRA padding as vLLM's sharded_state loader allows it). Then
the files are read in parallel straight into the parameters, each file's checksum verified on the way
(`--model-loader-extra-config '{"checksums": false}'` skips that). With `{"strict": false}` the
parameters the folder lacks are logged at WARNING, named, and left as initialised (vLLM PR "[Core][V1]
Support sharded state loading" proposed that switch for sharded_state); anything else still refuses.

With `{"weights": "s3://bucket/prefix/"}` the model folder holds the output's config and tokenizer
only, and the manifest and rank files come from the bucket (`remote`), checked and verified the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

from reshard import settings
from reshard.errors import ReshardError
from reshard.format import DTYPE_NAMES
from reshard.layout import DTYPES, Layout
from reshard.manifest import read_manifest
from reshard.names import CONFIG
from reshard.vllm_plugin import checks, messages
from reshard.vllm_plugin.checks import Engine, ReshardLoadError
from reshard.vllm_plugin.copied import copied_message, copied_problems
from reshard.vllm_plugin.reader import ReadError, read_rank
from reshard.vllm_plugin.remote import BucketWeights

# a logger under "vllm." so that the lines appear in vLLM's log, formatted as vLLM's own
logger = init_logger("vllm.reshard")

_OTHER_DTYPES = {"int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
                 "float64": "F64", "uint16": "U16", "uint32": "U32", "uint64": "U64"}  # fmt: skip


def dtype_code(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name) or _OTHER_DTYPES.get(name) or name


class ReshardModelLoader(BaseModelLoader):
    """Loads a reshard folder exactly as recorded, or refuses before reading a byte."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = checks.parse_options(load_config.model_loader_extra_config)
        self._vllm_config: VllmConfig | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        _folder(model_config)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self._vllm_config = vllm_config
        return super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        folder = _folder(model_config)
        try:
            direct_reads = settings.DIRECT_READS.get()
        except ReshardError as e:
            raise ReshardLoadError(f"--load-format reshard: {e}") from None
        bucket = BucketWeights(self.options.weights) if self.options.weights else None
        where: Path | str = folder
        if bucket is not None:  # the model folder: the config; the bucket: the manifest and the weights
            where = str(bucket)
            manifest = bucket.manifest()
            if problems := bucket.config_problems(folder, manifest):
                raise ReshardLoadError(bucket.config_message(folder, problems))
        else:
            try:
                manifest = read_manifest(folder)
            except ReshardError as e:
                raise ReshardLoadError(f"--load-format reshard: {e}") from None
            # first: an edited config.json built another model, whose mismatch would be told as a layout's
            if problems := copied_problems(folder, manifest, hashed=self.options.checksums, always=(CONFIG,)):
                raise ReshardLoadError(copied_message(folder, problems, messages.SHOWN))
        engine = self._engine(model_config)
        problems = checks.engine_problems(manifest, engine)
        if problems:
            raise ReshardLoadError(messages.mismatch_message(where, manifest, engine, problems))
        entries = checks.rank_entries(manifest, engine)
        if twice := checks.duplicates(entries):
            raise ReshardLoadError(
                f"--load-format reshard: {where} is malformed (tp rank {engine.tp_rank}, pp rank {engine.pp_rank}): {twice[0]}"
                f"{f' (and {len(twice) - 1} more)' if len(twice) > 1 else ''}. To fix: `reshard verify {where}`, "
                "then save the folder again"
            )
        _retie_word_embeddings(model, model_config)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        model_state = {k: (dtype_code(v.dtype), tuple(v.shape)) for k, v in state.items()}
        recorded = checks.expected_state(entries)
        problems = checks.state_problems(recorded, model_state, lora=engine.lora, strict=self.options.strict)
        missing = checks.missing_keys(recorded, model_state)
        if problems:
            only = len(problems) == len(missing)  # each key the folder lacks is one problem
            raise ReshardLoadError(messages.state_message(where, manifest, engine, problems, missing_only=only))
        missing = [] if self.options.strict else missing
        algorithm = manifest.checksum
        if bucket is not None:
            files = bucket.check_objects(manifest, entries, engine)
        else:
            files = checks.check_files(folder, manifest, entries, engine)
        verify = self.options.checksums and algorithm != "none"
        if self.options.checksums and algorithm == "none":  # the folder's choice, not this engine's: say so
            logger.warning(messages.unverified_message(where, engine))
        logger.info(
            "reshard: %s: reading %d file(s), %s, checksums %s",
            engine.label,
            len(files),
            _size(sum(f.size for f in files)),
            algorithm if verify else "off",
        )
        try:
            nbytes, seconds, bad = read_rank(
                files,
                state,
                algorithm=algorithm if verify else None,
                threads=self.options.threads,
                log=logger.info,
                label=engine.label,
                source=bucket,
                direct_reads=direct_reads,
            )
        except ReadError as e:
            raise ReshardLoadError(
                f"--load-format reshard: {e}; the parameters are partly loaded: do not serve"
            ) from None
        if bad:
            first = bad[0]
            raise ReshardLoadError(
                f"--load-format reshard: {where} ({engine.label}): {len(bad)} file(s) differ from their recorded "
                f"checksum, e.g. {first.name} ({algorithm} {first.got[:16]}..., recorded {first.want[:16]}...): "
                f"the files changed after reshard wrote them; nothing may be served from them. "
                f"To fix: {messages.damage_fix(where)}"
            )
        logger.info(
            "reshard: %s: %s in %.2f s (%s/s), %s",
            engine.label,
            _size(nbytes),
            seconds,
            _size(int(nbytes / max(seconds, 1e-9))),
            f"{algorithm} verified" if verify else "checksums not verified",
        )
        if missing:  # read_rank fills only what the files hold: these keep their initial values
            logger.warning(messages.missing_message(where, engine, missing))
        # vLLM's own line, logged as its loaders log it (rank 0); every rank's figure is in the line above
        logger.info_once("Loading weights took %.2f seconds", seconds)

    def _engine(self, model_config: ModelConfig) -> Engine:
        import vllm
        from vllm.config import get_current_vllm_config_or_none
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        cfg = self._vllm_config or get_current_vllm_config_or_none()
        if cfg is None:
            raise ReshardLoadError("--load-format reshard: no vLLM config is set (load_weights outside an engine?)")
        par = cfg.parallel_config
        dtype = str(model_config.dtype).removeprefix("torch.")
        mm = getattr(model_config, "multimodal_config", None)  # None: a text model
        lm_only = bool(mm is not None and mm.language_model_only)
        layout = Layout(
            tp=par.tensor_parallel_size,
            pp=par.pipeline_parallel_size,
            ep=bool(par.enable_expert_parallel),
            dtype=dtype if dtype in DTYPES else "auto",  # another dtype than reshard writes: never a match
            moe_backend=str(getattr(cfg.kernel_config, "moe_backend", "auto")),
            platform=_platform(),
            mm_encoder_tp_mode=None if mm is None or lm_only else str(mm.mm_encoder_tp_mode),
            language_model_only=lm_only,
        )
        return Engine(
            layout=layout,
            quantization=model_config.quantization,
            vllm_version=vllm.__version__,
            tp_rank=get_tensor_model_parallel_rank(),
            pp_rank=get_pp_group().rank_in_group,
            lora=cfg.lora_config is not None,
        )


def _platform() -> str | None:
    """The naming platform of the running vLLM (reshard.layout.PLATFORMS): XPU runs the generic
    (CPU-named) classes; None for a platform reshard does not name."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cpu() or current_platform.is_xpu():
        return "cpu"
    return None


def _retie_word_embeddings(model: nn.Module, model_config: ModelConfig) -> None:
    """Undo vLLM's untying of tied word embeddings for this load format.

    vLLM unties them when the config says tied but the checkpoint holds an `lm_head.weight`
    (`ModelConfig.maybe_untie_word_embeddings`), except for the formats it knows to store tied
    embeddings under the lm_head only, "sharded_state" among them (`VllmConfig.__post_init__`); it
    cannot know "reshard" is one. A reshard folder's config.json says tied only when they are (a
    checkpoint with its own lm_head is written untied), so tie them again before loading, as
    sharded_state builds the model."""
    if not getattr(model_config, "word_embeddings_untied_by_checkpoint", False):
        return
    from vllm.model_executor.model_loader.weight_tying import _get_untied_lm_head

    untied = _get_untied_lm_head(model)
    if untied is None:
        return
    untied.tie(model)
    model_config.hf_config.tie_word_embeddings = True
    model_config.hf_config.get_text_config().tie_word_embeddings = True
    model_config.word_embeddings_untied_by_checkpoint = False


def _folder(model_config: ModelConfig) -> Path:
    path = Path(model_config.model_weights or model_config.model)
    if not path.is_dir():
        raise ReshardLoadError(
            f"--load-format reshard: {path} is not a local folder; it loads a folder `reshard save` wrote (for an "
            'output in a bucket: a local copy of its config and tokenizer, with {"weights": "s3://bucket/prefix/"})'
        )
    return path


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
