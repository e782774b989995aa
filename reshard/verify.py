"""`reshard verify`: check an output folder before it ships.

Four layers of checks, cheapest first:

- structure: the manifest `reshard.json` is present and valid; every file it lists exists with its
  size, its safetensors header parses and holds what the manifest says, and was written by the
  manifest's run; every rank of the layout has files; no stray rank files lie around.
- keys: the keys, dtypes and shapes every rank must hold are derived again (the copied config.json
  plus the source headers recorded in the manifest, or `--against SOURCE`) and diffed per rank with
  what the headers hold, each difference told as vLLM's ShardedStateLoader would meet it.
- integrity: sha256 of every file against the manifest (large sequential reads, files in parallel).
- deep (`--against SOURCE --deep`): every output byte regenerated from the source by the executor
  and compared with the file, naming the first differing tensor of each file.

Findings, not exceptions: `verify()` returns a `Report` whose exit code is 0 (ok), 6 (the layout
differs from the recorded or requested one) or 7 (corrupt or incomplete; wins over 6).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import math
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from reshard.errors import CorruptError, ExitCode, SourceError, UnsupportedError
from reshard.format import DTYPE_CODES, ITEMSIZE, MAX_HEADER, TensorInfo, read_header
from reshard.manifest import MANIFEST, read_manifest
from reshard.plan import OutFile, OutTensor, Plan, build_plan, natural_key
from reshard.source import Checkpoint, open_checkpoint, read_config

READ_BLOCK = 16 * 1024 * 1024
MAX_PER_FILE = 20  # deep: differing tensors reported per file (the count of the rest is given)

ERROR, WARNING = "error", "warning"
LAYOUT, CORRUPT = int(ExitCode.LAYOUT_MISMATCH), int(ExitCode.CORRUPT)

_TP_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
_PP_FILE = re.compile(r"^model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors$")
_RERUN = "rerun `reshard save --overwrite`"
_FOREIGN = "or check a folder without manifest with --against SOURCE --tp T"

# Advance callback for one byte-heavy phase: progress(label, total_bytes) -> advance(n) or None.
Progress = Callable[[str, int], "Callable[[int], None] | None"]


@dataclass
class Finding:
    """One problem. `code` is the exit code it maps to (6 layout, 7 corrupt); 0 for warnings."""

    severity: str  # "error" | "warning"
    kind: str
    message: str
    file: str | None = None
    tensor: str | None = None
    code: int = 0

    def to_json(self) -> dict:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "file": self.file,
            "tensor": self.tensor,
            "message": self.message,
            "exit_code": self.code,
        }


@dataclass
class FileStat:
    name: str
    pp_rank: int | None
    tp_rank: int | None
    part: int | None
    keys: int | None = None
    size: int | None = None
    sha256: str | None = None  # as computed (None when not hashed)


@dataclass
class Report:
    out_dir: Path
    findings: list[Finding] = field(default_factory=list)
    files: list[FileStat] = field(default_factory=list)
    layout: dict | None = None  # the layout the folder was checked as
    recorded: dict | None = None  # the manifest's layout, when there is one
    run_id: str | None = None
    source: str | None = None  # --against
    checked: list[str] = field(default_factory=list)  # what was checked: structure, keys, ...
    stats: dict = field(default_factory=dict)  # bytes and seconds of the hash and deep phases

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def exit_code(self) -> int:
        codes = {f.code for f in self.errors}
        if CORRUPT in codes:
            return CORRUPT
        if LAYOUT in codes:
            return LAYOUT
        return int(ExitCode.OK)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def file_findings(self, name: str) -> list[Finding]:
        return [f for f in self.findings if f.file == name]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "out_dir": str(self.out_dir),
            "layout": self.layout,
            "recorded_layout": self.recorded,
            "run_id": self.run_id,
            "against": self.source,
            "checked": self.checked,
            "files": [
                {
                    "name": s.name,
                    "pp_rank": s.pp_rank,
                    "tp_rank": s.tp_rank,
                    "part": s.part,
                    "keys": s.keys,
                    "bytes": s.size,
                    "sha256": s.sha256,
                    "errors": sum(1 for f in self.file_findings(s.name) if f.severity == ERROR),
                    "warnings": sum(1 for f in self.file_findings(s.name) if f.severity == WARNING),
                }
                for s in self.files
            ],
            "keys": sum(s.keys or 0 for s in self.files),
            "bytes": sum(s.size or 0 for s in self.files),
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [f.to_json() for f in self.findings],
            "stats": self.stats,
        }


@dataclass
class _File:
    """One rank file as found: manifest entry (if any), size, parsed header."""

    name: str
    pp_rank: int
    tp_rank: int
    part: int
    entry: dict | None = None
    size: int | None = None  # None: absent
    tensors: dict[str, TensorInfo] | None = None  # None: header unreadable (or file absent)
    meta: dict[str, str] = field(default_factory=dict)
    sha256: str | None = None

    @property
    def rank(self) -> tuple[int, int]:
        return (self.pp_rank, self.tp_rank)

    @property
    def ok(self) -> bool:
        return self.tensors is not None


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    ep: bool
    dtype: str = "auto"  # user-facing name
    partition: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={'on' if self.ep else 'off'}"

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dtype": self.dtype}


def rank_label(rank: tuple[int, int], pp: int) -> str:
    return f"rank pp={rank[0]} tp={rank[1]}" if pp > 1 else f"rank {rank[1]}"


class _Verifier:
    def __init__(
        self,
        out_dir: Path,
        *,
        strict: bool,
        tp: int | None,
        ep: bool | None,
        pp: int | None,
        checksums: bool,
        against: str | None,
        deep: bool,
        revision: str | None,
        progress: Progress | None,
    ) -> None:
        self.out = out_dir
        self.strict = strict
        self.asked = (tp, pp, ep)
        self.checksums = checksums
        self.against = against
        self.deep = deep
        self.revision = revision
        self.progress = progress
        self.report = Report(out_dir, source=against)
        self.manifest: dict | None = None
        self.files: list[_File] = []
        self.layout: _Layout | None = None
        self.reported: set[tuple[str | None, str | None]] = set()  # (file, tensor) of key findings
        self.rank_code = CORRUPT  # missing or extra ranks: incomplete, or (foreign folder) another layout
        self.asked_layout: _Layout | None = None  # --tp/--pp/--ep, where they differ from the recorded layout
        self.plan_ckpt: Checkpoint | None = None  # what the expected plan was built from

    # ---- findings ----------------------------------------------------------------------------

    def add(self, kind: str, message: str, *, code: int, file: str | None = None, tensor: str | None = None,
            warn: bool = False) -> None:  # fmt: skip
        sev = WARNING if warn else ERROR
        self.report.findings.append(Finding(sev, kind, message, file, tensor, 0 if warn else code))

    # ---- driver ------------------------------------------------------------------------------

    def run(self) -> Report:
        if not self.out.is_dir():
            self.add("missing", f"{self.out}: no such folder", code=CORRUPT)
            return self.report
        has_manifest = self._load_manifest()
        if has_manifest:
            self._manifest_files()
        elif self.against is not None:
            self._foreign_files()
        else:
            return self.report  # the manifest finding says what to do
        if self.layout is None:
            return self.report
        self.report.layout = self.layout.to_json()
        self._check_structure()
        ckpt = None
        if self.against is not None:
            ckpt = open_checkpoint(self.against, self.revision, headers_only=not self.deep)
            self._compare_source_tensors(ckpt)
        expected = self._expected(ckpt)
        self._check_asked(expected)
        pending = self._check_headers_vs_manifest()
        if expected is not None:
            self.report.checked.append("keys")
            self._check_keys(expected)
        for f in pending:  # header-vs-manifest differences the key check did not already tell
            if (f.file, f.tensor) not in self.reported:
                self.report.findings.append(f)
        if self.deep and ckpt is not None and expected is not None:
            self.report.checked.append("deep")
            self._deep(expected, ckpt, [f for f in self.files if f.ok])
        if self.checksums and self.manifest is not None:
            self.report.checked.append("checksums")
            damaged = self._check_sums()
            if damaged and not self.deep:
                self._locate(damaged, expected, ckpt)
        self._fill_stats()
        return self.report

    # ---- manifest ----------------------------------------------------------------------------

    def _load_manifest(self) -> bool:
        present = (self.out / MANIFEST).exists()
        try:
            manifest = read_manifest(self.out)
            problems = _manifest_problems(manifest)
            if problems:
                raise CorruptError(f"{self.out / MANIFEST}: malformed manifest ({problems[0]})")
        except CorruptError as e:
            if not present and self.against is not None:
                self.add("manifest", f"no {MANIFEST}: not written by reshard; checked against {self.against} only "
                         "(no checksums, no run ids)", code=CORRUPT, warn=True)  # fmt: skip
                return False
            pieces = None if present else _pieces(self.out)
            if pieces:
                self.add("manifest", pieces, code=CORRUPT, file=MANIFEST)
                return False
            hint = e.hint or ""
            if "--against" not in hint:
                hint = f"{hint or _RERUN}, {_FOREIGN}"
            self.add("manifest", f"{e.message} ({hint})", code=CORRUPT, file=MANIFEST)
            return False  # with --against, what can be checked still is, as for a foreign folder
        self.manifest = manifest
        self.report.run_id = manifest["run_id"]
        self.report.checked.append("manifest")
        return True

    def _manifest_files(self) -> None:
        m = self.manifest
        assert m is not None
        lay = m["layout"]
        dtype = str(lay.get("dtype") or "auto")
        dtype = DTYPE_CODES.get(dtype, dtype)
        partition = lay.get("pp_layer_partition")
        recorded = _Layout(int(lay["tp"]), int(lay["pp"]), bool(lay["ep"]), dtype,
                           tuple(partition) if partition else None)  # fmt: skip
        self.report.recorded = recorded.to_json()
        tp, pp, ep = self.asked
        asked = _Layout(tp or recorded.tp, pp or recorded.pp, recorded.ep if ep is None else ep, dtype)
        if (asked.tp, asked.pp, asked.ep) != (recorded.tp, recorded.pp, recorded.ep):
            self.asked_layout = asked  # told by _check_asked, once the expected keys are known
        self.layout = recorded
        for e in m["files"]:
            self.files.append(_File(e["name"], int(e["pp_rank"]), int(e["tp_rank"]), int(e["part"]), entry=e))

    def _foreign_files(self) -> None:
        found = []
        for p in sorted(self.out.iterdir(), key=lambda p: natural_key(p.name)):
            if m := _PP_FILE.match(p.name):
                found.append(_File(p.name, int(m[1]), int(m[2]), int(m[3])))
            elif m := _TP_FILE.match(p.name):
                found.append(_File(p.name, 0, int(m[1]), int(m[2])))
        tp, pp, ep = self.asked
        pp_files = [f for f in found if _PP_FILE.match(f.name)]
        pp = pp or (max(f.pp_rank for f in pp_files) + 1 if pp_files else 1)
        if tp is None:
            ranks = [f.tp_rank for f in found if bool(_PP_FILE.match(f.name)) == (pp > 1)]
            tp = max(ranks) + 1 if ranks else 1
            self.add("layout", f"no --tp given: assuming tp={tp} from the file names", code=LAYOUT, warn=True)
        self.layout = _Layout(tp, pp, bool(ep))
        pattern = _PP_FILE if pp > 1 else _TP_FILE
        named = [f for f in found if pattern.match(f.name)]
        if named:
            n_tp, n_pp = max(f.tp_rank for f in named) + 1, max(f.pp_rank for f in named) + 1
            if (n_tp, n_pp) != (tp, pp):
                # the folder is whole for another layout: what is missing or extra follows from that
                self.rank_code = LAYOUT
                had = f"tp={n_tp}" + (f" pp={n_pp}" if pp > 1 else "")
                if tp * pp > n_tp * n_pp:
                    effect = "the ranks beyond find no files and vLLM fails to start"
                else:
                    effect = (f"vLLM would load only the first {tp * pp} rank(s)' files, each holding 1/{n_tp} of "
                              "every split weight: shapes differ, and smaller ones load silently half-filled")  # fmt: skip
                self.add("layout", f"the files are named for {had}, you asked {self.layout}: {effect}", code=LAYOUT)
        for f in found:
            if not pattern.match(f.name) or f.tp_rank >= tp or f.pp_rank >= pp:
                self.add("stray", f"{f.name} does not belong to a {self.layout} layout (a rank this layout does "
                         "not have, or another naming pattern): remove it", code=self.rank_code, file=f.name)  # fmt: skip
            else:
                self.files.append(f)
        if not found:
            self.add("missing", f"{self.out}: no model-rank-*.safetensors files", code=CORRUPT)

    # ---- structure ---------------------------------------------------------------------------

    def _check_structure(self) -> None:
        self.report.checked.append("structure")
        lay = self.layout
        assert lay is not None
        for f in self.files:
            stat = FileStat(f.name, f.pp_rank, f.tp_rank, f.part)
            self.report.files.append(stat)
            path = self.out / f.name
            try:
                f.size = path.stat().st_size
            except FileNotFoundError:
                self.add("missing-file", f"{f.name} is missing ({rank_label(f.rank, lay.pp)} cannot load)",
                         code=CORRUPT, file=f.name)  # fmt: skip
                continue
            except OSError as e:
                self.add("missing-file", f"{f.name}: cannot stat ({e.strerror})", code=CORRUPT, file=f.name)
                continue
            stat.size = f.size
            want = f.entry["size"] if f.entry else None
            if want is not None and f.size != want:
                cut = _cut_tensors(path, f.size) if f.size < want else []
                what = "truncated" if f.size < want else "larger than written"
                msg = f"{f.name} is {what}: {f.size} bytes, the manifest says {want}"
                if cut:
                    msg += f"; tensor {cut[0]} is cut" + (f" ({len(cut) - 1} more after it)" if len(cut) > 1 else "")
                self.add("size", msg, code=CORRUPT, file=f.name, tensor=cut[0] if cut else None)
            try:
                tensors, meta, _ = read_header(path)
            except SourceError as e:
                if not (want is not None and f.size != want and "truncated" in e.message):
                    self.add("header", _strip_path(e.message, path), code=CORRUPT, file=f.name)
                continue
            f.tensors, f.meta = tensors, meta
            stat.keys = len(tensors)
            if self.manifest is not None:
                run = meta.get("reshard_run")
                if run != self.manifest["run_id"]:
                    said = f"run {run[:12]}" if run else "no reshard run (not written by reshard)"
                    self.add("run-mix", f"{f.name} comes from {said}, the manifest from run "
                             f"{self.manifest['run_id'][:12]}: files of two runs are mixed ({_RERUN})",
                             code=CORRUPT, file=f.name)  # fmt: skip
        # every rank of the layout has files
        have = {f.rank for f in self.files}
        for p in range(lay.pp):
            for t in range(lay.tp):
                if (p, t) not in have:
                    where = "the manifest lists" if self.manifest is not None else "there is"
                    self.add("rank-missing", f"{rank_label((p, t), lay.pp)}: {where} no file for it (vLLM: "
                             "'Could not find checkpoint files' on that rank)", code=self.rank_code)  # fmt: skip
        if self.manifest is not None:
            extra = sorted({f.rank for f in self.files if f.tp_rank >= lay.tp or f.pp_rank >= lay.pp})
            for r in extra:
                self.add("manifest", f"the manifest lists files for {rank_label(r, lay.pp)}, outside {lay}",
                         code=CORRUPT, file=MANIFEST)  # fmt: skip
            listed = {f.name for f in self.files}
            for p in sorted(self.out.iterdir(), key=lambda p: natural_key(p.name)):
                if (_TP_FILE.match(p.name) or _PP_FILE.match(p.name)) and p.name not in listed:
                    self.add("stray", f"{p.name} is not in the manifest (left by another run?): vLLM would load "
                             f"it with its rank; remove it or {_RERUN}", code=CORRUPT, file=p.name)  # fmt: skip
            for name in self.manifest.get("copied") or []:
                if not (self.out / name).exists():
                    self.add("missing-file", f"{name} (copied from the source) is missing", code=CORRUPT, file=name)
        if not (self.out / "config.json").is_file():
            self.add("missing-file", "config.json is missing: vLLM needs it to serve the folder", code=CORRUPT,
                     file="config.json")  # fmt: skip
        for p in self.out.glob(".reshard-tmp-*"):
            self.add("leftover", f"{p.name}: temporary folder of an interrupted save (safe to remove)",
                     code=CORRUPT, file=p.name, warn=True)  # fmt: skip

    def _check_headers_vs_manifest(self) -> list[Finding]:
        out = []
        for f in self.files:
            if not f.ok or not f.entry:
                continue
            listed = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in f.entry.get("tensors", [])}
            held = {n: (t.dtype, t.shape) for n, t in f.tensors.items()}
            for name in sorted(set(listed) | set(held), key=natural_key):
                a, b = listed.get(name), held.get(name)
                if a == b:
                    continue
                if b is None:
                    msg = f"{f.name}: the manifest lists {name}, the file does not hold it"
                elif a is None:
                    msg = f"{f.name} holds {name}, which the manifest does not list"
                else:
                    msg = f"{f.name}: {name} is {b[0]} {list(b[1])}, the manifest says {a[0]} {list(a[1])}"
                out.append(Finding(ERROR, "manifest-mismatch", msg, f.name, name, CORRUPT))
        return out

    # ---- keys --------------------------------------------------------------------------------

    def _compare_source_tensors(self, ckpt: Checkpoint) -> None:
        recorded = (self.manifest or {}).get("source_tensors")
        if not recorded:
            return
        have = {n: [t.dtype, list(t.shape)] for n, t in ckpt.tensors.items()}
        diff = sorted(set(recorded) ^ set(have)) + sorted(n for n in recorded if n in have and recorded[n] != have[n])
        if diff:
            self.add("source", f"{self.against} is not the checkpoint this folder was made from: {len(diff)} tensor "
                     f"header(s) differ (first: {diff[0]})", code=LAYOUT, tensor=diff[0], warn=True)  # fmt: skip

    def _expected(self, ckpt: Checkpoint | None) -> Plan | None:
        lay = self.layout
        assert lay is not None
        if ckpt is None:
            assert self.manifest is not None
            src = self.manifest.get("source_tensors")
            if not src:
                self.add("keys", "the manifest records no source_tensors (an older reshard): keys checked against "
                         "the manifest only; pass --against SOURCE for the full check", code=LAYOUT, warn=True)  # fmt: skip
                return None
            try:
                config = read_config(self.out)
            except SourceError as e:
                self.add("keys", f"cannot derive the expected keys: {e.message}", code=CORRUPT, warn=True)
                return None
            try:
                tensors = {}
                for name, (dtype, shape) in src.items():
                    shape = tuple(int(d) for d in shape)
                    tensors[name] = TensorInfo(name, dtype, shape, MANIFEST, 0, math.prod(shape) * ITEMSIZE[dtype])
            except (KeyError, TypeError, ValueError) as e:
                self.add("manifest", f"malformed source_tensors in {MANIFEST} ({e})", code=CORRUPT, file=MANIFEST)
                return None
            ckpt = Checkpoint(None, config, tensors, [], self.manifest["source"])
        try:
            plan = _plan(ckpt, lay)
        except UnsupportedError as e:
            self.add("keys", f"{lay} cannot be planned for this model: {e}", code=LAYOUT)
            return None
        except SourceError as e:
            what = self.against or "config.json and the manifest's source_tensors"
            self.add("keys", f"cannot derive the expected keys from {what}: {e}", code=CORRUPT)
            return None
        self.plan_ckpt = ckpt
        return plan

    def _check_asked(self, expected: Plan | None) -> None:
        """--tp/--pp/--ep differ from the recorded layout: an error, unless the files would be the
        same (--ep on a dense model, or with --tp 1)."""
        asked, rec = self.asked_layout, self.layout
        if asked is None or rec is None:
            return
        if expected is not None and (asked.tp, asked.pp) == (rec.tp, rec.pp):
            try:
                same = _rank_keys(_plan(self.plan_ckpt, replace(rec, ep=asked.ep))) == _rank_keys(expected)
            except (UnsupportedError, SourceError):
                same = False
            if same:
                self.add("layout", f"made for {rec}, you asked {asked}: for this model both have the same files",
                         code=LAYOUT, warn=True)  # fmt: skip
                return
        flags = f"--tensor-parallel-size {rec.tp}"
        flags += f" --pipeline-parallel-size {rec.pp}" if rec.pp > 1 else ""
        flags += " --enable-expert-parallel" if rec.ep else ""
        self.add(
            "layout",
            f"made for {rec}, you asked {asked}: these files only load with `vllm serve ... "
            f"--load-format sharded_state {flags}`; re-save for {asked} with `reshard save "
            f"--tp {asked.tp}{f' --pp {asked.pp}' if asked.pp > 1 else ''}{' --ep' if asked.ep else ''}`",
            code=LAYOUT,
        )

    def _check_keys(self, plan: Plan) -> None:
        pp = plan.pp
        expected: dict[tuple[int, int], dict[str, OutTensor]] = {}
        for f in plan.files:
            expected.setdefault((f.pp_rank, f.tp_rank), {}).update({t.name: t for t in f.tensors})
        by_rank: dict[tuple[int, int], list[_File]] = {}
        for f in self.files:
            by_rank.setdefault(f.rank, []).append(f)
        listed_in: dict[tuple[tuple[int, int], str], str] = {}  # where the manifest puts a tensor
        for f in self.files:
            for t in (f.entry or {}).get("tensors", []):
                listed_in[(f.rank, t["name"])] = f.name
        for rank in sorted(by_rank):
            files = by_rank[rank]
            want = expected.get(rank)
            if want is None or not all(f.ok for f in files):
                continue  # outside the layout, or damaged: already reported
            label = rank_label(rank, pp)
            held: dict[str, tuple[_File, TensorInfo]] = {}
            for f in sorted(files, key=lambda f: f.part):
                for name, info in f.tensors.items():
                    if name in held:
                        self._key("duplicate-key", f"{name} is also in {held[name][0].name} (vLLM: KeyError when the "
                                  "second copy loads)", f.name, label, name)  # fmt: skip
                        continue
                    held[name] = (f, info)
            for name in sorted(set(want) | set(held), key=natural_key):
                w, h = want.get(name), held.get(name)
                if h is None:
                    where = listed_in.get((rank, name)) or files[0].name
                    self._key("missing-key", f"{name} is missing (vLLM: ValueError 'Missing keys' at load)",
                              where, label, name, warn=not self.strict)  # fmt: skip
                elif w is None:
                    self._key("unexpected-key", f"{name} is not a parameter of this layout (vLLM: KeyError in "
                              "ShardedStateLoader)", h[0].name, label, name)  # fmt: skip
                else:
                    f, info = h
                    if info.shape != w.shape:
                        self._key("shape", f"{name} has shape {list(info.shape)}, {plan_dims(plan)} needs "
                                  f"{list(w.shape)} ({_shape_effect(info.shape, w.shape)})", f.name, label, name)  # fmt: skip
                    if info.dtype != w.dtype:
                        self._key("dtype", f"{name} is {info.dtype}, the layout needs {w.dtype} (vLLM's copy_ casts "
                                  "it silently)", f.name, label, name)  # fmt: skip

    def _key(self, kind: str, message: str, file: str, label: str, tensor: str, *, warn: bool = False) -> None:
        self.add(kind, f"{file} ({label}): {message}", code=LAYOUT, file=file, tensor=tensor, warn=warn)
        self.reported.add((file, tensor))

    # ---- checksums ---------------------------------------------------------------------------

    def _check_sums(self) -> list[_File]:
        todo = [f for f in self.files if f.entry and f.size is not None and f.size == f.entry["size"]]
        hashed_already = [f for f in todo if f.sha256 is not None]  # during --deep
        todo = [f for f in todo if f.sha256 is None]
        total = sum(f.size for f in todo)
        advance = _advance(self.progress, "hashing", total)
        t0 = time.monotonic()
        workers = max(1, min(len(todo), os.cpu_count() or 4, 16))
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="reshard-sha") as pool:
            futures = {
                pool.submit(sha256_file, self.out / f.name, advance): f
                for f in sorted(todo, key=lambda f: -f.size)  # largest first: balanced threads
            }
            for fut in cf.as_completed(futures):
                f = futures[fut]
                try:
                    f.sha256 = fut.result()
                except OSError as e:
                    self.add("checksum", f"{f.name}: cannot read ({e.strerror})", code=CORRUPT, file=f.name)
        if total:
            self.report.stats["hashed_bytes"] = total
            self.report.stats["hash_seconds"] = round(time.monotonic() - t0, 3)
        damaged = []
        for f in hashed_already + todo:
            stat = next(s for s in self.report.files if s.name == f.name)
            stat.sha256 = f.sha256
            if f.sha256 is not None and f.sha256 != f.entry["sha256"]:
                damaged.append(f)
        for f in damaged:
            named = self._per_tensor_sums(f)
            if named:
                for t in named:
                    self.add("checksum", f"{f.name}: tensor {t} differs from what was written (sha256)",
                             code=CORRUPT, file=f.name, tensor=t)  # fmt: skip
                continue
            hint = "" if self.against else "; add --against SOURCE to find the damaged tensor"
            self.add("checksum", f"{f.name}: sha256 differs from the manifest: the file changed after it was "
                     f"written ({_RERUN}{hint})", code=CORRUPT, file=f.name)  # fmt: skip
        return damaged

    def _per_tensor_sums(self, f: _File) -> list[str]:
        """With per-tensor sha256 in the manifest (when save records them), name the damaged tensors."""
        sums = {t["name"]: t.get("sha256") for t in f.entry.get("tensors", [])}
        if not f.ok or not all(sums.get(n) for n in f.tensors):
            return []
        bad = []
        with open(self.out / f.name, "rb", buffering=0) as fh:
            for name, info in sorted(f.tensors.items(), key=lambda kv: kv[1].offset):
                h, left, buf = hashlib.sha256(), info.nbytes, bytearray(min(READ_BLOCK, max(info.nbytes, 1)))
                fh.seek(info.offset)
                while left:
                    n = fh.readinto(memoryview(buf)[: min(left, len(buf))])
                    if not n:
                        break
                    h.update(memoryview(buf)[:n])
                    left -= n
                if h.hexdigest() != sums[name]:
                    bad.append(name)
        return bad

    def _locate(self, damaged: list[_File], expected: Plan | None, ckpt: Checkpoint | None) -> None:
        """With --against (not --deep): compare the damaged files with the source to name the tensor."""
        if ckpt is None or expected is None or ckpt.root is None:
            return
        self._deep(expected, ckpt, [f for f in damaged if f.ok], hash_too=False)
        for f in damaged:
            if f.ok and not any(x.kind == "data" for x in self.report.file_findings(f.name)):
                self.add("checksum", f"{f.name}: every tensor equals what {self.against} produces: the change is "
                         "in the header or its metadata", code=CORRUPT, file=f.name, warn=True)  # fmt: skip

    # ---- deep --------------------------------------------------------------------------------

    def _deep(self, expected: Plan, ckpt: Checkpoint, files: list[_File], *, hash_too: bool | None = None) -> None:
        """Regenerate each file's tensors from the source with the executor; compare byte for byte."""
        from reshard.execute import Executor  # numpy-heavy; only when asked
        from reshard.io import FileReader

        if hash_too is None:
            hash_too = self.checksums and self.manifest is not None
        want: dict[tuple[int, int], dict[str, OutTensor]] = {}
        for f in expected.files:
            want.setdefault((f.pp_rank, f.tp_rank), {}).update({t.name: t for t in f.tensors})
        out_files, infos = [], {}
        for f in files:
            w = want.get(f.rank, {})
            ts = [w[n] for n, i in f.tensors.items() if n in w and w[n].dtype == i.dtype and w[n].shape == i.shape]
            ts.sort(key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))  # the executor's global order
            out_files.append(OutFile(f.name, f.tp_rank, f.pp_rank, f.part, tuple(ts)))
            infos[f.name] = f
        plan = replace(expected, files=out_files)
        total = sum(f.data_bytes for f in out_files)
        advance = _advance(self.progress, "comparing", total) or (lambda n: None)
        diffs: dict[str, list[tuple[str, str]]] = {}  # file -> (message, tensor)
        sinks: dict[str, _CompareSink] = {}

        def sink(of: OutFile, header: bytes) -> _CompareSink:
            f = infos[of.name]
            s = _CompareSink(self.out / f.name, f, diffs.setdefault(f.name, []), hash_too=hash_too)
            sinks[f.name] = s
            return s

        t0 = time.monotonic()
        reader = ckpt.reader_factory() if ckpt.reader_factory else FileReader(ckpt.root)
        Executor(plan, reader, ckpt.tensors, self.out, metadata={}, progress=advance, sync=False,
                 sink=sink).run()  # fmt: skip
        seconds = time.monotonic() - t0
        self.report.stats["compared_bytes"] = self.report.stats.get("compared_bytes", 0) + total
        self.report.stats["deep_seconds"] = round(self.report.stats.get("deep_seconds", 0) + seconds, 3)
        for name, s in sinks.items():
            if s.sha256 is not None:
                infos[name].sha256 = s.sha256
                self.report.stats["hashed_in_compare_bytes"] = (
                    self.report.stats.get("hashed_in_compare_bytes", 0) + infos[name].size
                )
        for f in files:
            found = sorted(diffs.get(f.name, []), key=lambda d: f.tensors[d[1]].offset)
            for msg, tensor in found[:MAX_PER_FILE]:
                self.add("data", msg, code=CORRUPT, file=f.name, tensor=tensor)
            if len(found) > MAX_PER_FILE:
                self.add("data", f"{f.name}: {len(found) - MAX_PER_FILE} more tensors differ from the source",
                         code=CORRUPT, file=f.name)  # fmt: skip

    def _fill_stats(self) -> None:
        st = self.report.stats
        if st.get("hash_seconds"):
            st["hash_gb_per_s"] = round(st["hashed_bytes"] / st["hash_seconds"] / 1e9, 3)
        if st.get("deep_seconds"):
            st["deep_gb_per_s"] = round(st["compared_bytes"] / st["deep_seconds"] / 1e9, 3)


def _plan(ckpt: Checkpoint, lay: _Layout) -> Plan:
    partition = list(lay.partition) if lay.partition else None
    return build_plan(ckpt, tp=lay.tp, pp=lay.pp, ep=lay.ep, dtype=lay.dtype, pp_partition=partition)


def _rank_keys(plan: Plan) -> dict[tuple[int, int], set[tuple[str, str, tuple[int, ...]]]]:
    out: dict[tuple[int, int], set] = {}
    for f in plan.files:
        out.setdefault((f.pp_rank, f.tp_rank), set()).update((t.name, t.dtype, t.shape) for t in f.tensors)
    return out


def plan_dims(plan: Plan) -> str:
    return f"tp={plan.tp}" + (f" pp={plan.pp}" if plan.pp > 1 else "") + (" ep" if plan.ep else "")


def _shape_effect(have: tuple[int, ...], want: tuple[int, ...]) -> str:
    if len(have) == len(want) and all(a <= b for a, b in zip(have, want, strict=True)):
        return "vLLM narrows the parameter to it and leaves the rest uninitialised"
    return "vLLM's copy_ fails with a size mismatch"


def _strip_path(message: str, path: Path) -> str:
    prefix = f"{path}: "
    return f"{path.name}: {message[len(prefix) :]}" if message.startswith(prefix) else message


def _manifest_problems(m: dict) -> list[str]:
    out = []
    lay = m.get("layout")
    if not isinstance(lay, dict):
        return ["layout is not an object"]
    for k in ("tp", "pp"):
        if not isinstance(lay.get(k), int) or lay[k] < 1:
            out.append(f"layout.{k} is {lay.get(k)!r}")
    if not isinstance(lay.get("ep"), bool):
        out.append(f"layout.ep is {lay.get('ep')!r}")
    part = lay.get("pp_layer_partition")
    if part is not None and (not isinstance(part, list) or not all(isinstance(x, int) for x in part)):
        out.append(f"layout.pp_layer_partition is {part!r}")
    if not isinstance(m.get("run_id"), str):
        out.append("run_id is not a string")
    files = m.get("files")
    if not isinstance(files, list):
        return [*out, "files is not a list"]
    seen = set()
    for i, e in enumerate(files):
        if not isinstance(e, dict):
            out.append(f"files[{i}] is not an object")
            continue
        name = e.get("name")
        if not isinstance(name, str) or not (_TP_FILE.match(name) or _PP_FILE.match(name)):
            out.append(f"files[{i}].name {name!r} is not a rank file name")
        elif name in seen:
            out.append(f"{name} is listed twice")
        seen.add(name)
        for k in ("tp_rank", "pp_rank", "part", "size"):
            if not isinstance(e.get(k), int) or e[k] < 0:
                out.append(f"files[{i}].{k} is {e.get(k)!r}")
        if not isinstance(e.get("sha256"), str):
            out.append(f"files[{i}].sha256 is {e.get('sha256')!r}")
        ts = e.get("tensors")
        if not isinstance(ts, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
            and isinstance(t.get("shape"), list) for t in ts
        ):  # fmt: skip
            out.append(f"files[{i}].tensors is malformed")
    src = m.get("source_tensors")
    if src is not None and not isinstance(src, dict):
        out.append("source_tensors is not an object")
    return out


def _pieces(out_dir: Path) -> str | None:
    """What a folder of `reshard save --ranks` pieces still lacks (its reshard.json comes last)."""
    found = sorted(out_dir.glob("reshard.ranks-*.json"))
    if not found:
        return None
    written, all_files, ranks = set(), [], []
    for p in found:
        try:
            piece = json.loads(p.read_text())
            written.update(f["name"] for f in piece["files"])
            all_files = all_files or list(piece.get("all_files") or [])
            ranks += list(piece.get("ranks") or [])
        except (OSError, ValueError, KeyError, TypeError):
            return f"{out_dir}: no {MANIFEST}, and {p.name} is unreadable ({_RERUN})"
    missing = [n for n in all_files if n not in written or not (out_dir / n).exists()]
    if not missing:
        return f"{out_dir}: every piece is written but not assembled: run `reshard assemble {out_dir}`"
    return (
        f"{out_dir}: incomplete --ranks save: {len(found)} piece(s) in (engine ranks {', '.join(map(str, sorted(ranks)))}), "
        f"{len(missing)} of {len(all_files)} files not written yet, e.g. {missing[0]}: run the missing "
        "`reshard save --ranks ...` pieces"
    )


def _cut_tensors(path: Path, size: int) -> list[str]:
    """Tensors of a truncated file that end past its size, in file order (lenient header parse)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return []
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER:
                return []
            obj = json.loads(f.read(n))
        obj.pop("__metadata__", None)
        ends = sorted((int(e["data_offsets"][1]), int(e["data_offsets"][0]), k) for k, e in obj.items())
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return []
    start = 8 + n
    return [k for end, _, k in ends if start + end > size]


def _advance(progress: Progress | None, label: str, total: int) -> Callable[[int], None]:
    cb = progress(label, total) if progress and total else None
    if cb is None:
        return lambda n: None
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            cb(n)

    return advance


def sha256_file(path: Path, advance: Callable[[int], None] | None = None, block: int = READ_BLOCK) -> str:
    """sha256 of a file: large sequential reads into one reused buffer (hashlib releases the GIL)."""
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            h.update(view[:n])
            if advance:
                advance(n)
    finally:
        os.close(fd)
    return h.hexdigest()


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """a == b for two uint8 arrays of one length, 8 bytes at a time (several GB/s)."""
    k = a.size & ~7
    if k and not np.array_equal(a[:k].view(np.uint64), b[:k].view(np.uint64)):
        return False
    return a[k:].tobytes() == b[k:].tobytes()


class _CompareSink:
    """A Sink for the executor: compares each regenerated tensor with the file's bytes.

    The file is read where its own header puts each tensor, so the header's metadata (run id, ...)
    does not matter. When the tensors arrive in file order, as reshard writes them, the reads are
    sequential and cover the whole file; the sha256 is then computed on a helper thread as a side
    effect, and the checksum pass skips the file.
    """

    def __init__(self, path: Path, f: _File, diffs: list, *, hash_too: bool) -> None:
        self.path = path
        self.file = f
        self.diffs = diffs
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.info: TensorInfo | None = None
        self.pos = 0
        self.bad = False
        self.bufs = [bytearray(0) for _ in range(3)]  # rotated, so hashing can trail the compare
        self.turn = 0
        self.hasher = None
        self.sha = None
        self.sha_pos = 0
        self.pending: list[cf.Future | None] = [None, None, None]
        self.sha256: str | None = None
        if hash_too:
            start = min((t.offset for t in f.tensors.values()), default=f.size)
            head = os.pread(self.fd, start, 0)
            self.sha = hashlib.sha256(head)
            self.sha_pos = len(head)
            self.hasher = cf.ThreadPoolExecutor(1, thread_name_prefix="reshard-deep-sha")

    def begin(self, tensor: OutTensor) -> None:
        self.info = self.file.tensors[tensor.name]
        self.pos = 0
        self.bad = False

    def write(self, data: memoryview | bytes) -> None:
        got = np.frombuffer(data, np.uint8)
        n = got.size
        if n == 0:
            return
        info = self.info
        assert info is not None
        off = info.offset + self.pos
        i = self.turn
        self.turn = (i + 1) % len(self.bufs)
        if self.pending[i] is not None:
            self.pending[i].result()  # the hash of this buffer's last contents is done
            self.pending[i] = None
        if len(self.bufs[i]) < n:
            self.bufs[i] = bytearray(n)
        view = memoryview(self.bufs[i])[:n]
        done = 0
        while done < n:
            k = os.preadv(self.fd, [view[done:]], off + done)
            if k == 0:
                break
            done += k
        have = np.frombuffer(view, np.uint8)
        if not self.bad and (done < n or not _equal(got, have)):
            diff = np.flatnonzero(got[:done] != have[:done])
            first = int(diff[0]) if diff.size else done  # done < n: the file ends early
            at = self.pos + first
            elem = at // ITEMSIZE[info.dtype]
            self.diffs.append(
                (
                    f"{self.file.name}: tensor {info.name} differs from the source from byte {at} of it "
                    f"(element {elem}; file offset {info.offset + at})",
                    info.name,
                )
            )
            self.bad = True
        if self.sha is not None:
            if off == self.sha_pos and done == n:
                self.pending[i] = self.hasher.submit(self.sha.update, view)
                self.sha_pos += n
            else:
                self._drop_hash()
        self.pos += n

    def _drop_hash(self) -> None:
        self.sha = None
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)
            self.hasher = None

    def close(self, sync: bool):
        from reshard.io import Written

        if self.hasher is not None:
            self.hasher.shutdown(wait=True)
            self.hasher = None
        if self.sha is not None and self.sha_pos == self.file.size:
            self.sha256 = self.sha.hexdigest()
        os.close(self.fd)
        return Written(self.file.name, self.file.size or 0, self.sha256 or "")

    def abort(self) -> None:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True, cancel_futures=True)
            self.hasher = None
        with contextlib.suppress(OSError):
            os.close(self.fd)


def verify(
    out_dir: Path,
    *,
    strict: bool = True,
    tp: int | None = None,
    ep: bool | None = None,
    pp: int | None = None,
    checksums: bool = True,
    against: str | None = None,
    deep: bool = False,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Check OUT_DIR; see the module docstring and `reshard verify --help`.

    Args:
        out_dir: a `reshard save` output (or, with `against`, any sharded_state folder).
        strict: missing keys are errors (vLLM refuses them); False: warnings.
        tp, ep, pp: the layout it will be served with; None: the recorded one.
        checksums: sha256 every file against the manifest.
        against: SOURCE checkpoint (folder or repo id) to derive the expected keys from.
        deep: with `against`, regenerate every tensor from the source and compare its bytes.
        revision: Hub revision of `against`.
        progress: progress(label, total_bytes) -> advance(n) callback, once per byte-heavy phase.

    Raises:
        ValueError: deep without against.
        SourceError: `against` cannot be opened.
    """
    if deep and not against:
        raise ValueError("deep needs against")
    v = _Verifier(Path(out_dir), strict=strict, tp=tp, ep=ep, pp=pp, checksums=checksums, against=against,
                  deep=deep, revision=revision, progress=progress)  # fmt: skip
    return v.run()
