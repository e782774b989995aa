"""verify --against SOURCE: the files copied beside the rank files (config, tokenizer, ...) are the
ones a save of SOURCE writes.

The manifest's digests prove a copied file unchanged since the save, not that the save copied it
from SOURCE: a folder that lies (a tokenizer swapped and the manifest's digest rewritten) passes
them. So the files are derived again from SOURCE by save's own rule (`reshard.sidefiles`, into a
temporary folder: the source's files, config.json rewritten where the plan patches it) and compared
byte for byte (sha256 of both sides). A file SOURCE gives that the output lacks is a warning (a
source folder may have gained a README since the save); one that differs, or one the output holds
that SOURCE does not give, is an error (exit 7).
"""

from __future__ import annotations

from dataclasses import replace

from reshard.checkpoint import Checkpoint
from reshard.errors import ReshardError
from reshard.format import NotRegular
from reshard.manifest import side_file_entries
from reshard.plan import Plan
from reshard.plan.remote import remote_code
from reshard.scratch import scratch_dir
from reshard.sidefiles import write_side_files
from reshard.verify.report import CORRUPT, Report
from reshard.verify.structure import Folder

ALGORITHM = "sha256"  # both sides hashed here, whatever the manifest records (--checksum none too)
TRUST_FLAG = "--trust-remote-code"


def compare_side_files(report: Report, folder: Folder, ckpt: Checkpoint, plan: Plan, against: str) -> None:
    """Report every copied file that is not what a save of `ckpt` (SOURCE, named `against`) writes;
    `plan`: the folder's layout planned from it (verify's expected plan: planned once)."""
    manifest = folder.manifest
    if manifest is None or ckpt.root is None or (manifest.copied and not manifest.copied_files):
        return  # no manifest, or one from before copied_files: nothing recorded; a source without files
    trust = TRUST_FLAG in manifest.serve.split()  # as the save was run: its code copied or left out
    try:
        plan = replace(plan, remote_code=remote_code(ckpt, plan.architecture, trust))
        with scratch_dir("verify") as tmp:
            names = write_side_files(ckpt, plan, tmp)
            want = {r.name: r for r in side_file_entries(tmp, names, ALGORITHM)}
    except ReshardError as e:
        report.add("copied", f"cannot derive the copied files from {against}: {e}", code=CORRUPT, warn=True)
        return
    have = {e.name for e in manifest.copied_files}
    for name in sorted(have - set(want)):
        msg = f"{name} (copied beside the rank files) is not a file a save of {against} writes"
        report.add("copied", msg, code=CORRUPT, file=name)
    for name in sorted(set(want) - have):
        msg = f"{name} of {against} is not among the output's copied files (added to the source since the save?)"
        report.add("copied", msg, code=CORRUPT, file=name, warn=True)
    view = folder.view
    for name in sorted(set(want) & have):
        rec = want[name]
        try:
            got = view.digest(name, ALGORITHM, size=rec.size)
        except (FileNotFoundError, NotRegular):
            continue  # told by the structure and checksum checks
        except (OSError, ReshardError) as e:
            why = e.strerror if isinstance(e, OSError) else e.message
            report.add("copied", f"{name}: cannot read ({why})", code=CORRUPT, file=name)
            continue
        if got != rec.digest:
            msg = f"{name} differs from what a save of {against} writes: not the source's file (re-save from it)"
            report.add("copied", msg, code=CORRUPT, file=name)
    report.checked.append("copied")
    report.stats["copied_files_compared"] = len(set(want) & have)
