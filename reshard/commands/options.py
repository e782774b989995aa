"""Options shared by several commands, declared once."""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Callable

import click

from reshard.layout import DTYPES, MM_ENCODER_TP_MODES, PLATFORMS, Layout
from reshard.plan.backends import MOE_BACKENDS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


class ByteSize(click.ParamType):
    """A byte count (`5GiB`, `500MB`, `1000000`), at least `minimum` where one is given (`why` says why)."""

    name = "SIZE"

    def __init__(self, minimum: int = 1, why: str = "") -> None:
        self.minimum, self.why = minimum, why

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            self.fail(f"{value!r} is not a size like 5GiB, 500MB or 1000000", param, ctx)
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if n <= 0:
            self.fail("must be positive", param, ctx)
        if n < self.minimum:
            self.fail(f"{value!r} is below {self.minimum // 2**20}MiB, {self.why}", param, ctx)
        return n


class Location(click.Path):
    """A folder, repo id or s3:// URL argument: completed as a path by shells; an empty one refused
    (`""` would silently mean the current folder); readability left to the command, which tells an
    unreadable SOURCE as a bad source (exit 4), not as a usage error."""

    def __init__(self, **kwargs) -> None:
        super().__init__(readable=False, **kwargs)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: give a folder (`.` for the current one)", param, ctx)
        if isinstance(value, str) and _too_long(value):  # no file can be there: known before any is read
            self.fail(f"{value}: File name too long (a name in a path is at most 255 bytes: shorten it)", param, ctx)
        return super().convert(value, param, ctx)


def _too_long(value: str) -> bool:
    """A local path the OS refuses as too long (a name over 255 bytes, or over 4096 in all); a URL is not a path."""
    if "://" in value:
        return False
    try:
        os.stat(value)
    except OSError as e:
        return e.errno == errno.ENAMETOOLONG
    return False


def parse_partition(value: str | None) -> list[int] | None:
    """`--pp-layer-partition 24,24,23,23` -> [24, 24, 23, 23]; each count a positive integer."""
    if not value:
        return None
    try:
        counts = [int(x) for x in value.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise click.BadParameter(
            f"{value!r}: expected comma-separated positive layer counts, e.g. 24,24,23,23",
            param_hint="'--pp-layer-partition'",
        )
    return counts


def _partition(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    return parse_partition(value)


tp_option = click.option(
    "--tp",
    "tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor-parallel size: vLLM's --tensor-parallel-size.",
)
pp_option = click.option(
    "--pp",
    "pp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Pipeline-parallel size: vLLM's --pipeline-parallel-size.",
)
ep_option = click.option(
    "--ep/--no-ep",
    "ep",
    default=False,
    show_default=True,
    help="Expert-parallel layout (vLLM's --enable-expert-parallel): MoE experts whole, spread over the ranks.",
)
dtype_option = click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="Model dtype vLLM will run with. auto: config.json's dtype (or torch_dtype; float32 becomes bfloat16, as vLLM "
    "on GPUs).",
)
revision_option = click.option("--revision", help="Hub branch, tag or commit (repo ids only).")
trust_remote_code_option = click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Copy the code the checkpoint ships (its .py files, named by an auto_map) and add --trust-remote-code "
    "to the serve line; without it that code is left out and config.json's auto_map dropped.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout; no progress.")
partition_option = click.option(
    "--pp-layer-partition",
    "pp_partition",
    metavar="N,N,...",
    callback=_partition,
    help="Layers per pipeline stage, as VLLM_PP_LAYER_PARTITION (give vLLM the same value).",
)
moe_backend_option = click.option(
    "--moe-backend",
    "moe_backend",
    default="auto",
    show_default=True,
    metavar="NAME",
    type=click.Choice(MOE_BACKENDS),
    help="vLLM's --moe-backend the folder is for. Some pad the experts (deep_gemm, flashinfer_*, marlin... with "
    "block FP8; flashinfer_trtllm, aiter with bf16); the serve line pins the backend whenever the layout "
    "depends on it.",
)
platform_option = click.option(
    "--platform",
    "platform",
    default="cuda",
    show_default=True,
    type=click.Choice(PLATFORMS),
    help="The vLLM platform that will serve the folder, where the model's key names depend on it "
    "(DeepSeek-V3.2 / GLM-5: vLLM's CUDA and CPU classes name the same weights differently); recorded, "
    "and the reshard loader refuses the folder on another platform. Ignored by other models.",
)

# issue 27: a multimodal model's encoder
mm_mode_option = click.option(
    "--mm-encoder-tp-mode",
    "mm_mode",
    type=click.Choice(MM_ENCODER_TP_MODES),
    default=None,
    help="vLLM's --mm-encoder-tp-mode for a multimodal model: weights (default: the vision tower TP-sharded) or "
    "data (whole on every rank); recorded and pinned in the serve line.",
)
lm_only_option = click.option(
    "--language-model-only",
    "lm_only",
    is_flag=True,
    help="vLLM's --language-model-only: write a multimodal model's text model alone (no vision tower).",
)


def layout_options(command: Callable) -> Callable:
    """--tp, --pp, --ep, --dtype, --pp-layer-partition, --moe-backend, --platform, --mm-encoder-tp-mode and
    --language-model-only, given to `command` as one `layout: Layout` (the defaults above are the only ones)."""

    @functools.wraps(command)
    def with_layout(*args, tp, pp, ep, dtype, pp_partition, moe_backend, platform, mm_mode, lm_only, **kwargs):
        partition = tuple(pp_partition) if pp_partition else None
        if partition and len(partition) != pp:  # known without the model: usage (one that misfits it: exit 3)
            raise click.BadParameter(
                f"{len(partition)} layer counts for --pp {pp}: give one per pipeline stage",
                param_hint="'--pp-layer-partition'",
            )
        layout = Layout(
            tp,
            pp,
            ep,
            dtype,
            partition,
            moe_backend,
            platform=platform,
            mm_encoder_tp_mode=mm_mode,
            language_model_only=lm_only,
        )
        return command(*args, layout=layout, **kwargs)

    for option in (
        platform_option,
        lm_only_option,
        mm_mode_option,
        moe_backend_option,
        partition_option,
        dtype_option,
        ep_option,
        pp_option,
        tp_option,
    ):
        with_layout = option(with_layout)
    return with_layout
