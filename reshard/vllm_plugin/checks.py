"""What `--load-format reshard` checks before it reads a tensor byte; no vLLM, no torch.

The loader describes the running engine (`Engine`) and the model's filtered `state_dict()` as plain
data; everything here compares that with the folder's manifest and files and turns the first
differences into one message that says what to run instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reshard.errors import SourceError
from reshard.format import DTYPE_CODES, TensorInfo, read_header
from reshard.hashing import entry_digest
from reshard.names import MANIFEST, file_pattern
from reshard.vllm_versions import in_range, recorded_range

SHOWN = 3  # differences named in a message


class ReshardLoadError(ValueError):
    """The folder does not fit the engine, or a file is not what the manifest says. One message."""


@dataclass(frozen=True)
class Options:
    """`--model-loader-extra-config` for `--load-format reshard`."""

    checksums: bool = True  # verify every file's checksum while reading
    threads: int = 4  # read streams per rank (files, and stripes of a file read into CPU memory)


def parse_options(extra: dict | None) -> Options:
    """The loader's options from vLLM's `model_loader_extra_config` (a JSON object). ValueError
    names an unknown key or a wrong type."""
    extra = dict(extra or {})
    checksums = extra.pop("checksums", True)
    threads = extra.pop("threads", Options.threads)
    if extra:
        raise ValueError(
            f"--load-format reshard: unknown --model-loader-extra-config key(s) {sorted(extra)}; "
            'it takes {"checksums": false} (skip checksum verification) and {"threads": N}'
        )
    if not isinstance(checksums, bool):
        raise ValueError(f'--load-format reshard: "checksums" must be true or false, not {checksums!r}')
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f'--load-format reshard: "threads" must be a positive integer, not {threads!r}')
    return Options(checksums=checksums, threads=threads)


@dataclass(frozen=True)
class Engine:
    """What the running vLLM engine is, as far as a folder's layout depends on it."""

    tp: int
    pp: int
    ep: bool
    dtype: str  # the model dtype, torch's name (as the manifest's layout records it)
    quantization: str | None  # vLLM's quantization method name
    moe_backend: str  # vLLM's --moe-backend
    vllm_version: str
    tp_rank: int = 0
    pp_rank: int = 0
    lora: bool = False  # --enable-lora: vLLM pads some parameters and loads into a narrowed view

    @property
    def label(self) -> str:
        return f"pp rank {self.pp_rank} tp rank {self.tp_rank}" if self.pp > 1 else f"rank {self.tp_rank}"


def engine_problems(manifest: dict, engine: Engine) -> list[str]:
    """How the folder's recorded layout differs from the engine, one sentence each; [] when it fits."""
    lay = manifest["layout"]
    out = []
    made = {"tp": lay.get("tp"), "pp": lay.get("pp"), "ep": bool(lay.get("ep"))}
    runs = {"tp": engine.tp, "pp": engine.pp, "ep": engine.ep}
    for k in ("tp", "pp", "ep"):
        if made[k] != runs[k]:
            out.append(f"made for {k}={_on(made[k])}, this engine runs {k}={_on(runs[k])}")
    if lay.get("dtype") != engine.dtype:
        out.append(f"made for dtype {lay.get('dtype')}, this engine runs {engine.dtype}")
    quant = (lay.get("quantization") or {}).get("method")
    if quant != engine.quantization:
        out.append(f"made for quantization {quant}, this engine runs quantization {engine.quantization}")
    # a pinned backend against another one asked for is a difference; against "auto" the model's state
    # decides (auto picks the pinned layout on some GPUs, another on others): see backend_note
    pinned = lay.get("moe_backend_pinned")
    if pinned and engine.moe_backend not in (pinned, "auto"):
        out.append(f"made for --moe-backend {pinned} (the experts' layout depends on it), this engine runs {engine.moe_backend}")  # fmt: skip
    spec = recorded_range(manifest)
    if spec is not None:
        try:
            ok = in_range(engine.vllm_version, spec)
        except ValueError:
            ok = False
        if not ok:
            out.append(f"made for vLLM {spec}, this is vLLM {engine.vllm_version}")
    return out


def _on(v: object) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def _dtype(code: object) -> str:
    return DTYPE_CODES.get(code, str(code)) if isinstance(code, str) else str(code)


def rank_entries(manifest: dict, engine: Engine) -> list[dict]:
    """The manifest's file entries of the engine's rank, by part."""
    mine = [f for f in manifest["files"] if (f["tp_rank"], f["pp_rank"]) == (engine.tp_rank, engine.pp_rank)]
    return sorted(mine, key=lambda f: f["part"])


def expected_state(entries: list[dict]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype code, shape) of every tensor the rank's files hold."""
    return {t["name"]: (t["dtype"], tuple(t["shape"])) for f in entries for t in f["tensors"]}


def state_problems(
    recorded: dict[str, tuple[str, tuple[int, ...]]], model: dict[str, tuple[str, tuple[int, ...]]], *, lora: bool
) -> list[str]:
    """How the model's filtered state dict differs from the rank's recorded tensors, model order first.

    Exact: same keys, dtypes and shapes. With LoRA on, vLLM pads some parameters beyond the
    checkpoint and loads into a narrowed view; a recorded shape no larger in any dimension is then
    accepted, as vLLM's sharded_state loader accepts it (nothing else is).
    """
    out = []
    for k, (dtype, shape) in model.items():
        if k not in recorded:
            out.append(f"{k}: the model has it ({_dtype(dtype)} {list(shape)}), the folder does not")
            continue
        rdtype, rshape = recorded[k]
        if rdtype != dtype:
            out.append(f"{k}: dtype {_dtype(rdtype)} in the folder, {_dtype(dtype)} in the model")
        elif rshape != shape and not (lora and fits_narrowed(rshape, shape)):
            out.append(f"{k}: shape {list(rshape)} in the folder, {list(shape)} in the model")
    out += [f"{k}: in the folder, not in the model" for k in recorded if k not in model]
    return out


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


def check_files(folder: Path, manifest: dict, entries: list[dict], engine: Engine, algorithm: str) -> list[RankFile]:
    """The rank's files as the manifest lists them, each checked from its size and header only:
    present, of the recorded size, a header holding exactly the recorded tensors, written by the
    manifest's run. Raises ReshardLoadError with every problem found (the first few named)."""
    problems: list[str] = []
    out: list[RankFile] = []
    if not entries:
        problems.append(f"the manifest lists no file for {engine.label}")
    for e in entries:
        path = folder / e["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{e['name']} is missing")
            continue
        except OSError as err:
            problems.append(f"{e['name']}: cannot read ({err.strerror})")
            continue
        if size != e["size"]:
            problems.append(f"{e['name']} has {size} bytes, the manifest says {e['size']}")
            continue
        try:
            infos, meta, _ = read_header(path)
        except SourceError as err:
            problems.append(err.message)
            continue
        run = meta.get("reshard_run")
        if run is not None and run != manifest["run_id"]:
            problems.append(
                f"{e['name']} was written by reshard run {run}, {MANIFEST} by run {manifest['run_id']}: "
                "the manifest comes from another run"
            )
            continue
        tensors = sorted(infos.values(), key=lambda t: t.offset)
        got = [(t.name, t.dtype, list(t.shape)) for t in tensors]
        want = [(t["name"], t["dtype"], list(t["shape"])) for t in e["tensors"]]
        if got != want:
            first = next((f"{g} != {w}" for g, w in zip(got, want, strict=False) if g != w), f"{len(got)} != {len(want)} tensors")  # fmt: skip
            problems.append(f"{e['name']}: its header does not hold the tensors the manifest lists ({first})")
            continue
        header = tensors[0].offset if tensors else size
        out.append(RankFile(path, size, header, tensors, entry_digest(e, algorithm)))
    listed = {e["name"] for e in entries}
    glob = file_pattern(engine.pp).format(rank=engine.tp_rank, tp_rank=engine.tp_rank, pp_rank=engine.pp_rank, part="*")  # fmt: skip
    for p in sorted(folder.glob(glob)):
        if p.name not in listed:
            problems.append(f"{p.name} is not in the manifest (a stray file sharded_state would also load)")
    if problems:
        raise ReshardLoadError(files_message(folder, engine, problems))
    return out


# ---- messages ------------------------------------------------------------------------------------------


def save_command(manifest: dict, engine: Engine) -> str:
    """The `reshard save` line that makes this folder's source for the engine as it runs."""
    src = manifest.get("source") or {}
    orig = src.get("resharded_from") if isinstance(src.get("resharded_from"), dict) else src
    where = orig.get("path") or orig.get("repo_id") or src.get("path") or "SOURCE"
    parts = ["reshard save", str(where), "OUT", f"--tp {engine.tp}"]
    if orig.get("repo_id") and orig.get("revision"):
        parts.append(f"--revision {orig['revision']}")
    if engine.pp > 1:
        parts.append(f"--pp {engine.pp}")
    if engine.ep:
        parts.append("--ep")
    if engine.dtype != manifest["layout"].get("dtype"):
        parts.append(f"--dtype {engine.dtype}")
    if engine.moe_backend != "auto":
        parts.append(f"--moe-backend {engine.moe_backend}")
    return " ".join(parts)


def serve_as_made(manifest: dict) -> str | None:
    line = manifest.get("serve_reshard") or manifest.get("serve")
    if not isinstance(line, str):
        return None
    return line.replace("--load-format sharded_state", "--load-format reshard")


def backend_note(manifest: dict, engine: Engine) -> str | None:
    """Why the experts may differ: the folder pins a MoE backend the engine left to "auto"."""
    pinned = manifest["layout"].get("moe_backend_pinned")
    if pinned and engine.moe_backend != pinned:
        return f"the folder was made for --moe-backend {pinned}, this engine runs {engine.moe_backend}"
    return None


def mismatch_message(folder: Path, manifest: dict, engine: Engine, problems: list[str]) -> str:
    """One message for a folder made for another engine or model: the first differences, then what to do."""
    head = "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    if (note := backend_note(manifest, engine)) and note not in head:
        head += f" ({note})"
    fix = f"make a folder for this engine with `{save_command(manifest, engine)}`"
    made = serve_as_made(manifest)
    if made:
        fix += f", or serve this one as it was made: `{made}`"
    return f"--load-format reshard: {folder} does not fit this engine ({engine.label}): {head}. To fix: {fix}"


def files_message(folder: Path, engine: Engine, problems: list[str]) -> str:
    head = "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    return (
        f"--load-format reshard: {folder} ({engine.label}): {head}. Nothing was loaded. "
        f"To fix: `reshard verify {folder}` tells every damaged file; re-save the folder (or restore the files)"
    )
