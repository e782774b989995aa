"""The integrity layer: every file's checksum against the manifest (large sequential reads, files in parallel)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

from reshard.errors import ReshardError
from reshard.format import NotRegular
from reshard.hashing import NONE
from reshard.verify.report import CORRUPT, RERUN, CheckedFile, Progress, Report, advance_for
from reshard.verify.structure import Folder

MAX_THREADS = 16


def check_sums(
    report: Report, folder: Folder, progress: Progress | None, against: str | None, only: set[str] | None = None
) -> list[CheckedFile]:
    """Hash the files of the manifest's size not hashed yet (--deep hashes while comparing), compare
    every sum with the manifest's (by the algorithm it names); returns the files that differ.
    only: these files alone (None: all)."""
    algorithm = folder.checksum
    report.stats["checksum"] = algorithm
    if algorithm == NONE:
        msg = (
            "the manifest records no checksums (saved with --checksum none): file contents "
            "not checked; sizes and headers were"
        )
        report.add("checksum", msg, code=0, warn=True)
        return []
    whole = [f for f in folder.files if f.entry and f.size is not None and f.size == f.entry.size]
    whole = [f for f in whole if only is None or f.name in only]
    hashed = [f for f in whole if f.digest is not None]
    todo = [f for f in whole if f.digest is None]
    _hash(report, folder, todo, progress, algorithm)
    damaged = [f for f in hashed + todo if f.digest is not None and f.entry and f.digest != f.entry.digest]
    hint = "" if against else "; add --against SOURCE to find the damaged tensor"
    for f in damaged:
        msg = f"{f.name}: {algorithm} differs from the manifest: the file changed after it was written ({RERUN}{hint})"
        report.add("checksum", msg, code=CORRUPT, file=f.name)
    return damaged


def check_side_files(report: Report, folder: Folder, only: set[str] | None = None) -> None:
    """Every file reshard copied (config, tokenizer, ...) is there, of its size and checksum: an
    edited config.json changes what vLLM builds as surely as a changed weight. only: these alone."""
    algorithm = folder.checksum
    entries = [e for e in (folder.manifest.copied_files if folder.manifest else ()) if only is None or e.name in only]
    view = folder.view
    for e in entries:
        try:
            digest = view.digest(e.name, algorithm, size=e.size)
        except NotRegular as err:
            msg = f"{e.name} (copied from the source) is {err.strerror}: not read ({RERUN})"
            report.add("not-regular", msg, code=CORRUPT, file=e.name)
            continue
        except FileNotFoundError:
            continue  # told by the structure check (a copied file is missing)
        except (OSError, ReshardError) as err:
            if not view.exists(e.name):
                continue
            why = err.strerror if isinstance(err, OSError) else err.message
            report.add("checksum", f"{e.name}: cannot read ({why})", code=CORRUPT, file=e.name)
            continue
        if digest != e.digest:
            msg = (
                f"{e.name} (copied from the source) changed after it was written: vLLM "
                f"would build the model from the edited file ({RERUN})"
            )
            report.add("checksum", msg, code=CORRUPT, file=e.name)
    if entries:
        report.stats["side_files_checked"] = len(entries)


def check_side_sizes(report: Report, folder: Folder) -> None:
    """Without checksums (--no-checksums, or a bucket without --deep), each copied file's size
    against the manifest's: the check that costs nothing still runs."""
    entries = folder.manifest.copied_files if folder.manifest else ()
    for e in entries:
        try:
            size = folder.view.size(e.name)
        except (OSError, ReshardError):
            continue  # missing or not regular: told by the structure check
        if size != e.size:
            msg = (
                f"{e.name} (copied from the source) is {size} bytes, the manifest says {e.size}: it changed "
                f"after it was written ({RERUN})"
            )
            report.add("size", msg, code=CORRUPT, file=e.name)


def _hash(report: Report, folder: Folder, todo: list[CheckedFile], progress: Progress | None, algorithm: str) -> None:
    """Set each file's digest, several files at once, largest first (balanced threads)."""
    total = sum(f.size for f in todo)
    advance = advance_for(progress, "hashing", total)
    t0 = time.monotonic()
    workers = max(1, min(len(todo), os.cpu_count() or 4, MAX_THREADS))
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="reshard-hash") as pool:
        futures = {
            pool.submit(folder.view.digest, f.name, algorithm, size=f.size, advance=advance): f
            for f in sorted(todo, key=lambda f: -f.size)
        }
        for fut in cf.as_completed(futures):
            f = futures[fut]
            try:
                f.digest = fut.result()
            except (OSError, ReshardError) as e:
                why = e.strerror if isinstance(e, OSError) else e.message
                report.add("checksum", f"{f.name}: cannot read ({why})", code=CORRUPT, file=f.name)
    if total:
        report.stats["hashed_bytes"] = total
        report.stats["hash_seconds"] = round(time.monotonic() - t0, 3)
