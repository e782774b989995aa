"""The keys layer: what every rank must hold, derived again, diffed with what its files hold.

The expected keys, dtypes and shapes come from planning the layout again: from the copied
config.json and the source headers recorded in the manifest, or from `--against SOURCE`. Each
difference is told as vLLM's ShardedStateLoader would meet it.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.format import ITEMSIZE, TensorInfo, records
from reshard.layout import Layout
from reshard.names import MANIFEST
from reshard.plan import OutTensor, Plan, build_plan, natural_key, num_experts
from reshard.sources import read_config
from reshard.verify.report import CORRUPT, LAX_LOADER, LAYOUT, CheckedFile, Report, rank_label
from reshard.verify.structure import Folder

Rank = tuple[int, int]  # (pp_rank, tp_rank)


def compare_source_tensors(report: Report, folder: Folder, ckpt: Checkpoint, against: str) -> None:
    """Warn when `against` is not the checkpoint the manifest says the folder was made from."""
    recorded = folder.manifest.source_tensors if folder.manifest else None
    if not recorded:
        return
    have = {n: (t.dtype, tuple(t.shape)) for n, t in ckpt.tensors.items()}
    diff = sorted(set(recorded) ^ set(have)) + sorted(n for n in recorded if n in have and recorded[n] != have[n])
    if diff:
        msg = (
            f"{against} is not the checkpoint this folder was made from: {len(diff)} tensor "
            f"header(s) differ (first: {diff[0]})"
        )
        report.add("source", msg, code=LAYOUT, tensor=diff[0], warn=True)


def expected_plan(
    report: Report, folder: Folder, ckpt: Checkpoint | None, against: str | None
) -> tuple[Plan, Checkpoint] | None:
    """The folder's layout planned again, from `ckpt` or (None) from the manifest; and what it was planned from."""
    if ckpt is None:
        ckpt = _recorded_source(report, folder)
        if ckpt is None:
            return None
    lay = folder.layout
    try:
        return plan_layout(ckpt, lay), ckpt
    except UnsupportedError as e:
        report.add("keys", f"{lay} cannot be planned for this model: {e}", code=LAYOUT)
    except SourceError as e:
        what = against or "config.json and the manifest's source_tensors"
        report.add("keys", f"cannot derive the expected keys from {what}: {e}", code=CORRUPT)
    return None


def _recorded_source(report: Report, folder: Folder) -> Checkpoint | None:
    """The source as the folder records it: config.json and the manifest's source_tensors."""
    assert folder.manifest is not None
    src = folder.manifest.source_tensors
    if not src:
        msg = (
            "the manifest records no source_tensors (an older reshard): keys checked against "
            "the manifest only; pass --against SOURCE for the full check"
        )
        report.add("keys", msg, code=LAYOUT, warn=True)
        return None
    try:
        config = read_config(folder.view)
    except SourceError as e:
        report.add("keys", f"cannot derive the expected keys: {e.message}", code=CORRUPT, warn=True)
        return None
    unknown = sorted(n for n, (dtype, _) in src.items() if dtype not in ITEMSIZE)
    if unknown:
        msg = f"malformed source_tensors in {MANIFEST} ({unknown[0]}: unknown dtype)"
        report.add("manifest", msg, code=CORRUPT, file=MANIFEST)
        return None
    tensors = records(src, MANIFEST)
    return Checkpoint(None, config, tensors, [], folder.manifest.source)


def plan_layout(ckpt: Checkpoint, lay: Layout) -> Plan:
    return build_plan(ckpt, lay)


def check_asked(report: Report, folder: Folder, expected: tuple[Plan, Checkpoint] | None) -> None:
    """--tp/--pp/--ep differ from the recorded layout: an error, unless the files would be the
    same (--ep on a dense model, or with --tp 1)."""
    asked, rec = folder.asked, folder.layout
    if asked is None:
        return
    if expected is not None and (asked.tp, asked.pp) == (rec.tp, rec.pp):
        plan, ckpt = expected
        try:
            if asked.ep != rec.ep and not num_experts(ckpt.config):
                same = True  # a dense model: --enable-expert-parallel changes nothing
            else:
                same = _rank_keys(plan_layout(ckpt, replace(rec, ep=asked.ep))) == _rank_keys(plan)
        except (UnsupportedError, SourceError):
            same = False
        if same:
            msg = f"made for {rec}, you asked {asked}: for this model both have the same files"
            report.add("layout", msg, code=LAYOUT, warn=True)
            return
    flags = f"--tensor-parallel-size {rec.tp}"
    flags += f" --pipeline-parallel-size {rec.pp}" if rec.pp > 1 else ""
    flags += " --enable-expert-parallel" if rec.ep else ""
    msg = (
        f"made for {rec}, you asked {asked}: these files only load with `vllm serve ... "
        f"--load-format sharded_state {flags}`; re-save for {asked} with `reshard save "
        f"--tp {asked.tp}{f' --pp {asked.pp}' if asked.pp > 1 else ''}{' --ep' if asked.ep else ''}`"
    )
    report.add("layout", msg, code=LAYOUT)


def _rank_keys(plan: Plan) -> dict[Rank, set[tuple[str, str, tuple[int, ...]]]]:
    out: dict[Rank, set] = {}
    for f in plan.files:
        out.setdefault((f.pp_rank, f.tp_rank), set()).update((t.name, t.dtype, t.shape) for t in f.tensors)
    return out


def expected_by_rank(plan: Plan) -> dict[Rank, dict[str, OutTensor]]:
    """The tensors each rank must hold, by name."""
    want: dict[Rank, dict[str, OutTensor]] = {}
    for f in plan.files:
        want.setdefault((f.pp_rank, f.tp_rank), {}).update({t.name: t for t in f.tensors})
    return want


# ---- the per-rank diff -------------------------------------------------------------------------------


class _KeyCheck:
    """Tells key differences, each on its file and tensor, and remembers which it told."""

    def __init__(self, report: Report, plan: Plan, strict: bool, manifest: bool) -> None:
        self.report = report
        self.plan = plan
        self.strict = strict
        self.manifest = manifest  # the folder has reshard.json: `--load-format reshard` can load it
        self.told: set[tuple[str | None, str | None]] = set()  # (file, tensor) told as an error

    def tell(self, kind: str, message: str, file: str, label: str, tensor: str, *, warn: bool = False) -> None:
        self.report.add(kind, f"{file} ({label}): {message}", code=LAYOUT, file=file, tensor=tensor, warn=warn)
        if not warn:  # a warning does not excuse the file differing from its manifest
            self.told.add((file, tensor))

    def missing(self, name: str) -> tuple[str, bool]:
        """What a missing key means, and whether it is only a warning: --lax excuses exactly what
        `--load-format reshard` with {"strict": false} loads (it reads the manifest)."""
        vllm = "vLLM's sharded_state: ValueError 'Missing keys' at load"
        if self.strict:
            return f"{name} is missing ({vllm})", False
        if self.manifest:
            return f"{name} is missing ({vllm}; {LAX_LOADER} leaves it as initialised)", True
        return (
            f"{name} is missing ({vllm}; --lax does not excuse it: without {MANIFEST}, {LAX_LOADER} cannot load "
            "the folder either; make it with `reshard save SOURCE OUT_DIR`)",
            False,
        )

    def held(self, files: list[CheckedFile], label: str) -> dict[str, tuple[CheckedFile, TensorInfo]]:
        """What a rank's files hold, by name; a second copy of a tensor is told."""
        held: dict[str, tuple[CheckedFile, TensorInfo]] = {}
        for f in sorted(files, key=lambda f: f.part):
            for name, info in f.tensors.items():
                if name in held:
                    msg = f"{name} is also in {held[name][0].name} (vLLM: KeyError when the second copy loads)"
                    self.tell("duplicate-key", msg, f.name, label, name)
                    continue
                held[name] = (f, info)
        return held

    def diff(self, rank: Rank, files: list[CheckedFile], want: dict[str, OutTensor], listed_in: dict) -> None:
        """One rank: missing and unexpected keys, shapes and dtypes."""
        label = rank_label(rank, self.plan.layout.pp)
        held = self.held(files, label)
        for name in sorted(set(want) | set(held), key=natural_key):
            w, h = want.get(name), held.get(name)
            if h is None:
                where = listed_in.get((rank, name)) or files[0].name
                msg, warn = self.missing(name)
                self.tell("missing-key", msg, where, label, name, warn=warn)
            elif w is None:
                msg = f"{name} is not a parameter of this layout (vLLM: KeyError in ShardedStateLoader)"
                self.tell("unexpected-key", msg, h[0].name, label, name)
            else:
                f, info = h
                if info.shape != w.shape:
                    msg = (
                        f"{name} has shape {list(info.shape)}, {plan_dims(self.plan)} needs "
                        f"{list(w.shape)} ({_shape_effect(info.shape, w.shape)})"
                    )
                    self.tell("shape", msg, f.name, label, name)
                if info.dtype != w.dtype:
                    msg = f"{name} is {info.dtype}, the layout needs {w.dtype} (vLLM's copy_ casts it silently)"
                    self.tell("dtype", msg, f.name, label, name)


def check_keys(report: Report, folder: Folder, plan: Plan, *, strict: bool) -> set[tuple[str | None, str | None]]:
    """Diff every rank's keys, dtypes and shapes with `plan`'s; returns the (file, tensor)s told as errors."""
    check = _KeyCheck(report, plan, strict, folder.manifest is not None)
    expected = expected_by_rank(plan)
    by_rank: dict[Rank, list[CheckedFile]] = {}
    for f in folder.files:
        by_rank.setdefault(f.rank, []).append(f)
    listed_in: dict[tuple[Rank, str], str] = {}  # where the manifest puts a tensor
    for f in folder.files:
        for t in f.entry.tensors if f.entry else ():
            listed_in[(f.rank, t.name)] = f.name
    for rank in sorted(by_rank):
        files = by_rank[rank]
        want = expected.get(rank)
        if want is None or not all(f.ok for f in files):
            continue  # outside the layout, or damaged: already reported
        check.diff(rank, files, want, listed_in)
    return check.told


def plan_dims(plan: Plan) -> str:
    lay = plan.layout
    return f"tp={lay.tp}" + (f" pp={lay.pp}" if lay.pp > 1 else "") + (" ep" if lay.ep else "")


def _shape_effect(have: tuple[int, ...], want: tuple[int, ...]) -> str:
    if len(have) == len(want) and all(a <= b for a, b in zip(have, want, strict=True)):
        return "vLLM narrows the parameter to it and leaves the rest uninitialised"
    return "vLLM's copy_ fails with a size mismatch"
