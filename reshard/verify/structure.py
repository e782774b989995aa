"""The structure layer: which files the folder should hold, and whether they are there and whole.

The manifest is present and valid; every file it lists exists with its size, its safetensors
header parses and holds what the manifest says, and was written by the manifest's run; every rank
of the layout has files; no stray rank files lie around. A folder without manifest (`--against`)
is read from its file names instead.

Files are read through a `FolderView` (reshard.folderview): a local folder or a bucket folder
(`s3://bucket/prefix/`, reshard.store.view); what only a local folder can have (symlinks, FIFOs,
staging folders) is checked on the local one, what only a bucket can have in `verify.bucket`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reshard.console import human_bytes
from reshard.errors import CorruptError, SourceError
from reshard.folderview import FolderView, LocalView, view_manifest
from reshard.format import NotRegular
from reshard.hashing import LEGACY
from reshard.layout import Layout
from reshard.manifest import Manifest, piece_paths
from reshard.manifest.pieces import read_pieces
from reshard.names import (
    CONFIG,
    FILE_NAME_META,
    MANIFEST,
    OLD,
    PP_PATTERN,
    RANK_FILE_GLOBS,
    STAGING,
    TMP_PREFIX,
    parse_rank_file,
    siblings,
    unlisted_rank_files,
    unlisted_side_files,
)
from reshard.plan import natural_key
from reshard.verify.report import CORRUPT, ERROR, LAYOUT, RERUN, CheckedFile, Finding, Report, rank_label

_FOREIGN = "or check a folder without manifest with --against SOURCE --tp T"
_PP_PREFIX = PP_PATTERN[: PP_PATTERN.index("{")]  # names of the pipeline-parallel pattern start so


@dataclass
class Folder:
    """The folder as verify checks it: its manifest (if any), its layout and the rank files it should hold.

    rank_code: the exit code of a missing or extra rank: corrupt (incomplete), or for a folder
        without manifest that is whole for another layout, a layout mismatch.
    asked: --tp/--pp/--ep, where they differ from the recorded layout.
    """

    view: FolderView
    manifest: Manifest | None
    layout: Layout
    files: list[CheckedFile] = field(default_factory=list)
    rank_code: int = CORRUPT
    asked: Layout | None = None

    @property
    def out(self) -> Path | None:
        """The folder, when it is local."""
        return self.view.local

    @property
    def checksum(self) -> str:
        """The algorithm of the manifest's digests (a manifest read here is valid, so it is known)."""
        return self.manifest.checksum if self.manifest is not None else LEGACY


def read_folder(
    report: Report, out: Path | FolderView, *, tp: int | None, pp: int | None, ep: bool | None, against: str | None
) -> Folder | None:
    """The manifest's files and layout, or without one (and `against`) what the file names say.

    None when there is nothing to check further (the findings say why).
    """
    out = out if isinstance(out, FolderView) else LocalView(out)
    manifest = _load_manifest(report, out, against)
    if manifest is not None:
        return _manifest_folder(report, out, manifest, tp=tp, pp=pp, ep=ep)
    if against is not None:
        return _foreign_folder(report, out, tp=tp, pp=pp, ep=ep)
    return None  # the manifest finding says what to do


def _load_manifest(report: Report, out: FolderView, against: str | None) -> Manifest | None:
    present = out.exists(MANIFEST)
    try:
        manifest = view_manifest(out)
    except CorruptError as e:
        if not present and against is not None:
            msg = f"no {MANIFEST}: not written by reshard; checked against {against} only (no checksums, no run ids)"
            report.add("manifest", msg, code=CORRUPT, warn=True)
            return None
        pieces = None if present or out.local is None else _pieces(out.local)
        if pieces:
            report.add("manifest", pieces, code=CORRUPT, file=MANIFEST)
            return None
        hint = e.hint or ""
        if "--against" not in hint:
            hint = f"{hint or RERUN}, {_FOREIGN}"
        report.add("manifest", f"{e.message} ({hint})", code=CORRUPT, file=MANIFEST)
        return None  # with --against, what can be checked still is, as for a foreign folder
    report.run_id = manifest.run_id
    report.checked.append("manifest")
    return manifest


def _manifest_folder(
    report: Report, out: FolderView, m: Manifest, *, tp: int | None, pp: int | None, ep: bool | None
) -> Folder:
    recorded = m.layout
    report.recorded = recorded
    asked = Layout(
        tp or recorded.tp,
        pp or recorded.pp,
        recorded.ep if ep is None else ep,
        recorded.dtype,
        moe_backend=recorded.moe_backend,
        platform=recorded.platform,
    )
    folder = Folder(out, m, recorded)
    if not asked.same_ranks(recorded):
        folder.asked = asked  # told by keys.check_asked, once the expected keys are known
    for e in m.files:
        folder.files.append(CheckedFile(e.name, e.pp_rank, e.tp_rank, e.part, entry=e))
    return folder


def _foreign_folder(report: Report, out: FolderView, *, tp: int | None, pp: int | None, ep: bool | None) -> Folder:
    """A folder without manifest: the rank files its names announce, checked as the asked layout."""
    found: list[tuple[CheckedFile, bool]] = []  # (file, named with the pipeline-parallel pattern)
    for name in sorted((n for n in out.names() if "/" not in n), key=natural_key):
        if r := parse_rank_file(name):
            found.append((CheckedFile(name, r.pp_rank, r.tp_rank, r.part), name.startswith(_PP_PREFIX)))
    pp_files = [f for f, is_pp in found if is_pp]
    pp = pp or (max(f.pp_rank for f in pp_files) + 1 if pp_files else 1)
    if tp is None:
        ranks = [f.tp_rank for f, is_pp in found if is_pp == (pp > 1)]
        tp = max(ranks) + 1 if ranks else 1
        report.add("layout", f"no --tp given: assuming tp={tp} from the file names", code=LAYOUT, warn=True)
    folder = Folder(out, None, Layout(tp, pp, bool(ep)))
    named = [f for f, is_pp in found if is_pp == (pp > 1)]
    if named:
        _tell_named_for(report, folder, n_tp=max(f.tp_rank for f in named) + 1, n_pp=max(f.pp_rank for f in named) + 1)
    for f, is_pp in found:
        if is_pp != (pp > 1) or f.tp_rank >= tp or f.pp_rank >= pp:
            msg = (
                f"{f.name} does not belong to a {folder.layout} layout (a rank this layout does "
                "not have, or another naming pattern): remove it"
            )
            report.add("stray", msg, code=folder.rank_code, file=f.name)
        else:
            folder.files.append(f)
    if not found:
        report.add("missing", f"{out.display}: no {RANK_FILE_GLOBS[0]} files", code=CORRUPT)
    return folder


def _tell_named_for(report: Report, folder: Folder, *, n_tp: int, n_pp: int) -> None:
    """The files are whole for another layout than the asked one: what is missing or extra follows."""
    lay = folder.layout
    if (n_tp, n_pp) == (lay.tp, lay.pp):
        return
    folder.rank_code = LAYOUT
    had = f"tp={n_tp}" + (f" pp={n_pp}" if lay.pp > 1 else "")
    if lay.tp * lay.pp > n_tp * n_pp:
        effect = "the ranks beyond find no files and vLLM fails to start"
    else:
        effect = (
            f"vLLM would load only the first {lay.tp * lay.pp} rank(s)' files, each holding 1/{n_tp} of "
            "every split weight: shapes differ, and smaller ones load silently half-filled"
        )
    report.add("layout", f"the files are named for {had}, you asked {lay}: {effect}", code=LAYOUT)


# ---- structure -------------------------------------------------------------------------------------


def check_structure(report: Report, folder: Folder) -> None:
    """Files present, sized and parsing, of the manifest's run; every rank covered; nothing stray."""
    report.checked.append("structure")
    report.files = folder.files
    for f in folder.files:
        _check_file(report, folder, f)
    _check_ranks(report, folder)
    if folder.manifest is not None:
        _check_against_manifest(report, folder)
    out = folder.out
    if not folder.view.exists(CONFIG) or (out is not None and not (out / CONFIG).is_file()):
        report.add("missing-file", f"{CONFIG} is missing: vLLM needs it to serve the folder", code=CORRUPT, file=CONFIG)
    if out is None:
        return
    for p in out.glob(f"{TMP_PREFIX}*"):
        msg = f"{p.name}: temporary folder of an interrupted save (safe to remove)"
        report.add("leftover", msg, code=CORRUPT, file=p.name, warn=True)
    for p in [*siblings(out, STAGING), *siblings(out, OLD), *out.glob(f"{STAGING}*")]:
        where = "inside the folder" if p.parent.resolve() == out.resolve() else "beside the folder"
        msg = f"{p.name} {where}: left by an interrupted save ({_du(p)}; safe to remove, or rerun save)"
        report.add("leftover", msg, code=CORRUPT, file=p.name, warn=True)


def _du(folder: Path) -> str:
    size = sum(p.lstat().st_size for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())
    return human_bytes(size)


def _check_file(report: Report, folder: Folder, f: CheckedFile) -> None:
    """One file: present, of the manifest's size, its header parses, written by the manifest's run."""
    view = folder.view
    try:
        f.size = view.size(f.name)
    except NotRegular as e:
        msg = f"{f.name} is {e.strerror}, not a regular file in the folder: not followed or read ({RERUN})"
        report.add("not-regular", msg, code=CORRUPT, file=f.name)
        return
    except FileNotFoundError:
        msg = f"{f.name} is missing ({rank_label(f.rank, folder.layout.pp)} cannot load)"
        report.add("missing-file", msg, code=CORRUPT, file=f.name)
        return
    except OSError as e:
        report.add("missing-file", f"{f.name}: cannot stat ({e.strerror})", code=CORRUPT, file=f.name)
        return
    want = f.entry.size if f.entry else None
    if want is not None and f.size != want:
        cut = _cut_tensors(view, f.name, f.size, want) if f.size < want else []
        what = "truncated" if f.size < want else "larger than written"
        msg = f"{f.name} is {what}: {f.size} bytes, the manifest says {want}"
        if cut:
            msg += f"; tensor {cut[0]} is cut" + (f" ({len(cut) - 1} more after it)" if len(cut) > 1 else "")
        report.add("size", msg, code=CORRUPT, file=f.name, tensor=cut[0] if cut else None)
    try:
        f.tensors, f.meta, _ = view.header(f.name)
    except SourceError as e:
        if not (want is not None and f.size != want and "truncated" in e.message):
            report.add("header", _strip_path(e.message, view.where(f.name), f.name), code=CORRUPT, file=f.name)
        return
    if folder.manifest is not None:
        run, want_run = f.meta.get("reshard_run"), folder.manifest.run_id
        if run != want_run:
            said = f"run {run[:12]}" if run else "no reshard run (not written by reshard)"
            msg = (
                f"{f.name} comes from {said}, the manifest from run {want_run[:12]}: files of "
                f"two runs are mixed ({RERUN})"
            )
            report.add("run-mix", msg, code=CORRUPT, file=f.name)
    named = f.meta.get(FILE_NAME_META)
    if named is not None and named != f.name:
        msg = f"{f.name} was written as {named}: rank files were renamed or swapped ({RERUN})"
        report.add("renamed", msg, code=CORRUPT, file=f.name)


def _check_ranks(report: Report, folder: Folder) -> None:
    """Every rank of the layout has files."""
    lay = folder.layout
    have = {f.rank for f in folder.files}
    where = "the manifest lists" if folder.manifest is not None else "there is"
    for p in range(lay.pp):
        for t in range(lay.tp):
            if (p, t) not in have:
                msg = (
                    f"{rank_label((p, t), lay.pp)}: {where} no file for it (vLLM: "
                    "'Could not find checkpoint files' on that rank)"
                )
                report.add("rank-missing", msg, code=folder.rank_code)


def _check_against_manifest(report: Report, folder: Folder) -> None:
    """No listed rank outside the layout, no unlisted rank file, every copied file present."""
    lay, view = folder.layout, folder.view
    extra = sorted({f.rank for f in folder.files if f.tp_rank >= lay.tp or f.pp_rank >= lay.pp})
    for r in extra:
        msg = f"the manifest lists files for {rank_label(r, lay.pp)}, outside {lay}"
        report.add("manifest", msg, code=CORRUPT, file=MANIFEST)
    listed = {f.name for f in folder.files}
    names = unlisted_rank_files((n for n in view.names() if "/" not in n), listed, tp=lay.tp, pp=lay.pp)
    for name in sorted(names, key=natural_key):
        msg = (
            f"{name} is not in the manifest (left by another run?): vLLM would load "
            f"it with its rank; remove it or {RERUN}"
        )
        report.add("stray", msg, code=CORRUPT, file=name)
    assert folder.manifest is not None
    for name in folder.manifest.copied:
        if not view.exists(name):
            report.add("missing-file", f"{name} (copied from the source) is missing", code=CORRUPT, file=name)
    if folder.manifest.copied_files:  # an output that records what it copied: nothing else is served with it
        for name in sorted(unlisted_side_files(view.names(), folder.manifest.copied)):
            msg = (
                f"{name} is not in the manifest (added after the save?): vLLM or its tokenizer would read it "
                f"(a chat template, a tokenizer file, a config); remove it, or {RERUN}"
            )
            report.add("unlisted-file", msg, code=CORRUPT, file=name)


def headers_vs_manifest(folder: Folder) -> list[Finding]:
    """Where a header and the manifest disagree on a tensor (kept back: the key check may tell it better)."""
    out = []
    for f in folder.files:
        if not f.ok or not f.entry:
            continue
        listed = {t.name: (t.dtype, t.shape) for t in f.entry.tensors}
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


# ---- helpers ---------------------------------------------------------------------------------------


def _strip_path(message: str, where: str, name: str) -> str:
    prefix = f"{where}: "
    return f"{name}: {message[len(prefix) :]}" if message.startswith(prefix) else message


def _cut_tensors(view: FolderView, name: str, size: int, written: int) -> list[str]:
    """Tensors of a file truncated from `written` to `size` bytes that end past its end, in file order."""
    try:
        tensors, _, _ = view.header(name, size=written)
    except SourceError:
        return []
    ends = sorted((t.offset + t.nbytes, t.offset, t.name) for t in tensors.values())
    return [name for end, _, name in ends if end > size]


def _pieces(out_dir: Path) -> str | None:
    """What a folder of `reshard save --ranks` pieces still lacks (its reshard.json comes last)."""
    if not piece_paths(out_dir):
        return None
    try:
        found = read_pieces(out_dir)
    except CorruptError as e:
        return f"{out_dir}: no {MANIFEST}, and {e.message} ({RERUN})"
    written, all_files, ranks = set(), [], []
    for piece in found:
        written.update(f.name for f in piece.files)
        all_files = all_files or list(piece.all_files or ())
        ranks += list(piece.ranks or ())
    missing = [n for n in all_files if n not in written or not (out_dir / n).exists()]
    if not missing:
        return f"{out_dir}: every piece is written but not assembled: run `reshard assemble {out_dir}`"
    in_ranks = ", ".join(map(str, sorted(ranks)))
    return (
        f"{out_dir}: incomplete --ranks save: {len(found)} piece(s) in (engine ranks {in_ranks}), "
        f"{len(missing)} of {len(all_files)} files not written yet, e.g. {missing[0]}: run the missing "
        "`reshard save --ranks ...` pieces"
    )
