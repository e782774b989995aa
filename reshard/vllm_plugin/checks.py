"""What `--load-format reshard` checks before it reads a tensor byte; no vLLM, no torch.

The loader describes the running engine (`Engine`) and the model's filtered `state_dict()` as plain
data; everything here compares that with the folder's manifest and files and turns the first
differences into one message that says what to run instead.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import ReshardError, SourceError, printable
from reshard.format import DTYPE_CODES, TensorInfo, kind, read_header
from reshard.layout import Layout
from reshard.manifest import FileRecord, Manifest
from reshard.names import FILE_NAME_META, MANIFEST, file_pattern
from reshard.serve import PLUGIN_WEIGHTS_KEY, STORE_SCHEME
from reshard.store.url import parse_bucket_url
from reshard.vllm_plugin.engine import Engine
from reshard.vllm_plugin.messages import files_message
from reshard.vllm_versions import in_range


class ReshardLoadError(ValueError):
    """The folder does not fit the engine, or a file is not what the manifest says. One message, its control
    characters escaped (`printable`) as in every line the CLI prints: a folder, bucket or file name holding an
    escape sequence or a line break cannot colour, erase or forge a line of vLLM's log."""

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


@dataclass(frozen=True)
class Options:
    """`--model-loader-extra-config` for `--load-format reshard`."""

    checksums: bool = True  # verify every file's checksum while reading
    threads: int = 4  # read streams per rank (files, and stripes of a file read into CPU memory)
    strict: bool = True  # False: parameters the folder lacks are logged (WARNING) and left as initialised
    weights: str | None = None  # s3://bucket/prefix/: the rank files are there, the model folder holds the rest


def parse_options(extra: dict | None) -> Options:
    """The loader's options from vLLM's `model_loader_extra_config` (a JSON object). ReshardLoadError (a
    ValueError) names an unknown key or a wrong type."""
    extra = dict(extra or {})
    checksums = extra.pop("checksums", True)
    threads = extra.pop("threads", Options.threads)
    strict = extra.pop("strict", True)
    weights = extra.pop(PLUGIN_WEIGHTS_KEY, None)
    if extra:
        raise ReshardLoadError(
            f"--load-format reshard: unknown --model-loader-extra-config key(s) {sorted(extra)}; "
            'it takes {"checksums": false} (skip checksum verification), {"threads": N}, '
            '{"strict": false} (load a folder that lacks some parameters, leaving them as initialised) and '
            f'{{"{PLUGIN_WEIGHTS_KEY}": "s3://bucket/prefix/"}} (the rank files are in a bucket, the model '
            "folder holds their config and tokenizer)"
        )
    for key, value in (("checksums", checksums), ("strict", strict)):
        if not isinstance(value, bool):
            raise ReshardLoadError(f'--load-format reshard: "{key}" must be true or false, not {value!r}')
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ReshardLoadError(f'--load-format reshard: "threads" must be a positive integer, not {threads!r}')
    if weights is not None:
        if not isinstance(weights, str) or not weights.startswith(STORE_SCHEME):
            raise ReshardLoadError(
                f'--load-format reshard: "{PLUGIN_WEIGHTS_KEY}" must be an {STORE_SCHEME}bucket/prefix/ URL, '
                f"not {weights!r}"
            )
        try:
            weights = str(parse_bucket_url(weights))
        except ReshardError as e:
            raise ReshardLoadError(f"--load-format reshard: {e}") from None
    return Options(checksums=checksums, threads=threads, strict=strict, weights=weights)


def engine_problems(manifest: Manifest, engine: Engine) -> list[str]:
    """How the folder's recorded layout differs from the engine, one sentence each; [] when it fits."""
    made, runs = manifest.layout, engine.layout
    out = []
    for k in ("tp", "pp", "ep"):
        if getattr(made, k) != getattr(runs, k):
            out.append(f"made for {k}={_on(getattr(made, k))}, this engine runs {k}={_on(getattr(runs, k))}")
    if made.dtype != runs.dtype:
        out.append(f"made for dtype {made.dtype}, this engine runs {runs.dtype}")
    quant = (made.quantization or {}).get("method")
    if quant != engine.quantization:
        out.append(f"made for quantization {quant}, this engine runs quantization {engine.quantization}")
    # a pinned backend against another one asked for is a difference; against "auto" the model's state
    # decides (auto picks the pinned layout on some GPUs, another on others): see backend_note
    pinned = made.moe_pin
    if pinned and runs.moe_backend not in (pinned, "auto"):
        out.append(
            f"made for --moe-backend {pinned} (the experts' layout depends on it), this engine runs {runs.moe_backend}"
        )
    # issue 27: DeepSeek-V3.2 / GLM-5 key names depend on vLLM's platform (its CUDA and CPU classes differ)
    if made.platform and runs.platform and made.platform != runs.platform:
        out.append(
            f"made for vLLM on {made.platform.upper()}, this engine runs on {runs.platform.upper()}: vLLM's "
            f"{manifest.architecture or 'model'} class names the weights differently there "
            f"(re-save with `reshard save --platform {runs.platform}`)"
        )
    out += mm_problems(made, runs)
    spec = manifest.vllm_versions
    if spec is not None:
        try:
            ok = in_range(engine.vllm_version, spec)
        except ValueError:
            ok = False
        if not ok:
            out.append(f"made for vLLM {spec}, this is vLLM {engine.vllm_version}")
    return out


def mm_problems(made: Layout, runs: Layout) -> list[str]:
    """A multimodal folder holds its encoder split for one --mm-encoder-tp-mode, or no encoder
    (--language-model-only); vLLM builds what its flags say and would load the wrong layout, or miss
    the encoder. Folders written before issue 27 record neither: not checked."""
    if made.mm_encoder_tp_mode is None and not made.language_model_only:
        return []
    if made.language_model_only != runs.language_model_only:
        if made.language_model_only:
            return [
                "made --language-model-only (the files hold no vision tower), this engine builds the vision tower "
                f"(--mm-encoder-tp-mode {runs.mm_encoder_tp_mode or 'weights'})"
            ]
        return [
            f"made with the vision tower (--mm-encoder-tp-mode {made.mm_encoder_tp_mode}), this engine runs "
            "--language-model-only and would not load it"
        ]
    if not made.language_model_only and made.mm_encoder_tp_mode != runs.mm_encoder_tp_mode:
        how = {"weights": "TP-sharded", "data": "whole on every rank"}
        return [
            f"made for --mm-encoder-tp-mode {made.mm_encoder_tp_mode} (the vision tower "
            f"{how.get(made.mm_encoder_tp_mode, '')}), this engine runs --mm-encoder-tp-mode {runs.mm_encoder_tp_mode}"
        ]
    return []


def _on(v: object) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def _dtype(code: object) -> str:
    return DTYPE_CODES.get(code, str(code)) if isinstance(code, str) else str(code)


def rank_entries(manifest: Manifest, engine: Engine) -> list[FileRecord]:
    """The manifest's file entries of the engine's rank, by part."""
    return manifest.rank_files(engine.pp_rank, engine.tp_rank)


def expected_state(entries: list[FileRecord]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype code, shape) of every tensor the rank's files hold."""
    return {t.name: (t.dtype, t.shape) for f in entries for t in f.tensors}


def duplicates(entries: list[FileRecord]) -> list[str]:
    """A tensor two of the rank's files hold (its reads would land in one parameter, the last one's bytes
    winning, and race the checksums of both): `reshard verify` calls the folder malformed."""
    seen: dict[str, str] = {}
    out = []
    for f in entries:
        for t in f.tensors:
            if t.name in seen and seen[t.name] != f.name:
                out.append(f"{t.name} is in {seen[t.name]} and {f.name}")
            seen.setdefault(t.name, f.name)
    return out


def state_problems(
    recorded: dict[str, tuple[str, tuple[int, ...]]],
    model: dict[str, tuple[str, tuple[int, ...]]],
    *,
    lora: bool,
    strict: bool = True,
) -> list[str]:
    """How the model's filtered state dict differs from the rank's recorded tensors, model order first.

    Exact: same keys, dtypes and shapes. With LoRA on, vLLM pads some parameters beyond the
    checkpoint and loads into a narrowed view; a recorded shape no larger in any dimension is then
    accepted, as vLLM's sharded_state loader accepts it (nothing else is). Not `strict`: a key the
    model has and the folder lacks is no problem here (`missing_keys` names them); a key the folder
    has and the model lacks, a dtype or a shape still is.
    """
    out = []
    for k, (dtype, shape) in model.items():
        if k not in recorded:
            if strict:
                out.append(f"{k}: the model has it ({_dtype(dtype)} {list(shape)}), the folder does not")
            continue
        rdtype, rshape = recorded[k]
        if rdtype != dtype:
            out.append(f"{k}: dtype {_dtype(rdtype)} in the folder, {_dtype(dtype)} in the model")
        elif rshape != shape and not (lora and fits_narrowed(rshape, shape)):
            out.append(f"{k}: shape {list(rshape)} in the folder, {list(shape)} in the model")
    out += [f"{k}: in the folder, not in the model" for k in recorded if k not in model]
    return out


def missing_keys(
    recorded: dict[str, tuple[str, tuple[int, ...]]], model: dict[str, tuple[str, tuple[int, ...]]]
) -> list[str]:
    """The model's keys the rank's recorded tensors lack, in model order."""
    return [k for k in model if k not in recorded]


def fits_narrowed(recorded: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether a recorded tensor loads into the leading corner of a (LoRA-padded) parameter."""
    return len(recorded) == len(param) and all(r <= p for r, p in zip(recorded, param, strict=True))


# ---- the rank's files, before reading them ---------------------------------------------------------


@dataclass(frozen=True)
class RankFile:
    path: Path
    size: int
    header_bytes: int  # 8 + the JSON header's length: where the data section starts
    tensors: list[TensorInfo]  # in file order
    digest: str | None  # what the manifest records (None: nothing to verify)


def check_files(folder: Path, manifest: Manifest, entries: list[FileRecord], engine: Engine) -> list[RankFile]:
    """The rank's files as the manifest lists them, each checked from its size and header only:
    present, of the recorded size, a header holding exactly the recorded tensors, written by the
    manifest's run. Raises ReshardLoadError with every problem found (the first few named)."""
    problems: list[str] = []
    out: list[RankFile] = []
    if not entries:
        problems.append(f"the manifest lists no file for {engine.label}")
    for e in entries:
        path = folder / e.name
        try:
            st = path.lstat()
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):  # a symlink, a FIFO: never followed, never waited on
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else kind(st.st_mode)
                problems.append(f"{e.name} is {what}, not a regular file in the folder")
                continue
        except FileNotFoundError:
            problems.append(f"{e.name} is missing")
            continue
        except OSError as err:
            problems.append(f"{e.name}: cannot read ({err.strerror})")
            continue
        if size != e.size:
            problems.append(f"{e.name} has {size} bytes, the manifest says {e.size}")
            continue
        try:
            infos, meta, _ = read_header(path, follow=False)
        except SourceError as err:
            problems.append(err.message)
            continue
        problem = header_problem(e, manifest, infos, meta)
        if problem:
            problems.append(problem)
            continue
        out.append(rank_file(path, size, e, infos))
    problems += stray_problems((p.name for p in folder.glob(rank_glob(engine))), entries)
    if problems:
        raise ReshardLoadError(files_message(folder, engine, problems))
    return out


def header_problem(e: FileRecord, manifest: Manifest, infos: dict[str, TensorInfo], meta: dict) -> str | None:
    """How a rank file's header differs from its manifest entry (another run, other tensors), or None."""
    run = meta.get("reshard_run")
    if run is not None and run != manifest.run_id:
        return (
            f"{e.name} was written by reshard run {run}, {MANIFEST} by run {manifest.run_id}: "
            "the manifest comes from another run"
        )
    named = meta.get(FILE_NAME_META)
    if named is not None and named != e.name:
        return f"{e.name} was written as {named}: rank files were renamed or swapped"
    tensors = sorted(infos.values(), key=lambda t: t.offset)
    got = [(t.name, t.dtype, list(t.shape)) for t in tensors]
    want = [(t.name, t.dtype, list(t.shape)) for t in e.tensors]
    if got != want:
        first = next(
            (f"{g} != {w}" for g, w in zip(got, want, strict=False) if g != w), f"{len(got)} != {len(want)} tensors"
        )
        return f"{e.name}: its header does not hold the tensors the manifest lists ({first})"
    return None


def rank_file(path: Path, size: int, e: FileRecord, infos: dict[str, TensorInfo]) -> RankFile:
    tensors = sorted(infos.values(), key=lambda t: t.offset)
    return RankFile(path, size, tensors[0].offset if tensors else size, tensors, e.digest)


def rank_glob(engine: Engine) -> str:
    """The names vLLM's sharded_state loader takes for the engine's rank."""
    return file_pattern(engine.layout.pp).format(
        rank=engine.tp_rank, tp_rank=engine.tp_rank, pp_rank=engine.pp_rank, part="*"
    )


def stray_problems(names: Iterable[str], entries: list[FileRecord]) -> list[str]:
    """`names` (the rank's files in the folder) the manifest does not list."""
    listed = {e.name for e in entries}
    return [
        f"{n} is not in the manifest (a stray file sharded_state would also load)"
        for n in sorted(names)
        if n not in listed
    ]
