"""`reshard verify`: check an output folder before it ships.

Four layers of checks, cheapest first:

- structure (`structure.py`): the manifest `reshard.json` is present and valid; every file it lists
  exists with its size, its safetensors header parses and holds what the manifest says, and was
  written by the manifest's run; every rank of the layout has files; no stray rank files lie around.
- keys (`keys.py`): the keys, dtypes and shapes every rank must hold are derived again (the copied
  config.json plus the source headers recorded in the manifest, or `--against SOURCE`) and diffed
  per rank with what the headers hold, each difference told as vLLM's ShardedStateLoader would meet it;
  with `--against SOURCE` the copied files too (`sidefiles.py`): each the file a save of SOURCE writes.
- integrity (`integrity.py`): every file's checksum against the manifest (the algorithm it names:
  blake3, sha256 for manifests without the field, or none).
- deep (`deep.py`, `--against SOURCE --deep`): every output byte regenerated from the source by the
  executor and compared with the file, naming the first differing tensor of each file.

A bucket folder (`s3://bucket/prefix/`, `bucket.py`) gets the same checks through ranged reads, plus
vLLM's listing (1000 keys, nested keys) and, instead of hashing every object, the store's checksum of
each (a HEAD) against the manifest's; `deep` (alone) streams and hashes every object, as verify does
unasked for the objects the store cannot vouch for (a note says so) when the manifest has digests.

Findings, not exceptions: `verify()` returns a `Report` (`report.py`) whose exit code is 0 (ok),
6 (the layout differs from the recorded or requested one) or 7 (corrupt or incomplete; wins over 6).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from reshard import vllm_versions
from reshard.folderview import FolderView, LocalView
from reshard.hashing import NONE
from reshard.io.memory import resident_bytes
from reshard.manifest import Manifest
from reshard.names import OLD, siblings
from reshard.serve import PLUGIN_LOAD_FORMAT, plain_line, serve_in
from reshard.sources import open_source
from reshard.sources.integrity import recorded_expected
from reshard.sources.local import LocalSource
from reshard.store import is_bucket_url, parse_bucket_url
from reshard.store.view import BucketView
from reshard.verify import bucket, integrity, keys, sidefiles, structure
from reshard.verify.deep import compare, locate
from reshard.verify.report import CORRUPT, LAX_EXTRA_CONFIG, LAX_LOADER, CheckedFile, Finding, Progress, Report

__all__ = ["CheckedFile", "Finding", "Progress", "Report", "verify"]


def verify(
    out_dir: Path | str,
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
    note: Callable[[str], None] | None = None,
) -> Report:
    """Check OUT_DIR; see the module docstring and `reshard verify --help`.

    Args:
        out_dir: a `reshard save` output (or, with `against`, any sharded_state folder), or
            `s3://bucket/prefix/` (str).
        strict: missing keys are errors (vLLM refuses them); False: warnings when the folder loads
            with `--load-format reshard` and {"strict": false} (it has a manifest), said in `loads_with`.
        tp, ep, pp: the layout it will be served with; None: the recorded one.
        checksums: hash every file against the manifest (with the algorithm it names).
        against: SOURCE checkpoint (folder or repo id) to derive the expected keys from.
        deep: with `against`, regenerate every tensor from the source and compare its bytes; a
            bucket without `against`: stream and hash every object (default: the store's checksums).
        revision: Hub revision of `against`.
        progress: progress(label, total_bytes) -> advance(n) callback, once per byte-heavy phase.
        note: told each of `Report.notes` as it is made (before the work it announces).

    Raises:
        ValueError: deep without against (a local folder).
        SourceError: `against` cannot be opened, or the bucket cannot be listed.
    """
    rss_base = resident_bytes()  # the metadata read from here on counts inside a compare's memory
    view = open_view(out_dir)
    if deep and not against and view.local is not None:
        raise ValueError("deep needs against")
    report = Report(view.local or view.display, source=against)
    if view.local is not None and not view.local.is_dir():
        kept = siblings(view.local, OLD)  # a save killed between its two renames left the previous output here
        said = (
            f"no such folder, but a previous output is kept beside it at {kept[-1]} (a save was killed "
            "mid-publish): rerun `reshard save`, which puts it back first, or rename it"
            if kept
            else "no such folder (check the path)"
        )
        report.add("missing", f"{view.local}: {said}", code=CORRUPT)
        return report
    if view.local is not None and not os.access(view.local, os.R_OK | os.X_OK):
        report.add(
            "unreadable", f"{view.local}: cannot read the folder (permission denied; make it readable)", code=CORRUPT
        )
        return report
    folder = structure.read_folder(report, view, tp=tp, pp=pp, ep=ep, against=against)
    if isinstance(view, BucketView):
        bucket.check_listing(report, view)
    if folder is None:
        return report
    report.layout = folder.asked or folder.layout  # as checked: --tp/--pp/--ep where given (recorded_layout beside it)
    if folder.manifest is not None:
        _check_vllm(report, folder.manifest)
    structure.check_structure(report, folder)
    source, ckpt = None, None
    if against is not None:
        source = open_source(against, revision, headers_only=not deep)
        ckpt = source.checkpoint
        if deep and folder.manifest is not None and isinstance(source, LocalSource):
            # bytes of a source changed since the save are its fault (exit 4), not the output's
            source.expect(recorded_expected(folder.manifest.source_files, ckpt.files))
        keys.compare_source_tensors(report, folder, ckpt, against)
    expected = keys.expected_plan(report, folder, ckpt, against)
    if ckpt is not None and expected is not None:
        sidefiles.compare_side_files(report, folder, ckpt, expected[0], against)
    keys.check_asked(report, folder, expected)
    pending = structure.headers_vs_manifest(folder)
    plan = expected[0] if expected is not None else None
    told: set = set()
    if plan is not None:
        report.checked.append("keys")
        told = keys.check_keys(report, folder, plan, strict=strict)
    # header-vs-manifest differences the key check did not already tell
    report.findings += [f for f in pending if (f.file, f.tensor) not in told]
    hash_too = checksums and folder.manifest is not None
    only: set[str] | None = None  # the objects to hash (None: every file)
    if hash_too and isinstance(view, BucketView):
        # every byte read when asked (--deep), or of the objects the store's checksums cannot vouch for
        only = set(bucket.check_store_sums(report, folder, view, deep=deep))
        for line in report.notes if note is not None else ():
            note(line)
        hash_too = bool(only)
        deep = deep and against is not None
    if deep and source is not None and plan is not None:
        report.checked.append("deep")
        files = [f for f in folder.files if f.ok]
        hashing = hash_too and folder.checksum != NONE
        compare(report, folder, plan, source, files, progress, hash_too=hashing, rss_base=rss_base)
        # the source's own sha256s, as a save checks them: bytes a Hub served wrong are the source's fault
        # (exit 4 naming its file), not differences of the output; a Hub source's cache is completed too
        source.finish()
    if hash_too:
        report.checked.append("checksums" if folder.checksum != NONE else "sizes")  # --checksum none: sizes only
        damaged = integrity.check_sums(report, folder, progress, against, only)
        integrity.check_side_files(report, folder, only)
        if damaged and not deep:
            locate(report, folder, damaged, plan, source, against, progress, rss_base)
    elif folder.manifest is not None and not checksums:  # --no-checksums: the sizes, which cost nothing
        integrity.check_side_sizes(report, folder)
    _fill_stats(report.stats)
    _loads_with(report, folder.manifest, str(out_dir))
    return report


def open_view(out_dir: Path | str) -> FolderView:
    """The folder verify checks: `s3://bucket/prefix/` or a local path."""
    if isinstance(out_dir, str) and is_bucket_url(out_dir):
        return BucketView(parse_bucket_url(out_dir))
    return LocalView(Path(out_dir))


def _loads_with(report: Report, manifest: Manifest | None, where: str) -> None:
    """How a passing folder loads. Missing keys excused by --lax: stock sharded_state refuses it (a
    warning says so), `--load-format reshard` with {"strict": false} loads it (the manifest's serve
    line for that loader, plus that setting); otherwise sharded_state loads it as is. The lines name
    the folder as verify was given it (`where`), not as it was saved (it may have moved)."""
    if not report.ok:
        return
    missing = [f for f in report.warnings if f.kind == "missing-key"]
    if not missing:
        serve = serve_in(manifest.serve, where) if manifest is not None and plain_line(manifest.serve) else None
        report.loads_with = {"load_format": "sharded_state", "strict": True, "model_loader_extra_config": None}
        report.loads_with["serve"] = serve
        return
    assert manifest is not None  # without one, --lax does not excuse missing keys (keys.py)
    line = manifest.serve_reshard or manifest.serve.replace(
        "--load-format sharded_state", f"--load-format {PLUGIN_LOAD_FORMAT}"
    )
    line = serve_in(line, where) if plain_line(line) else None
    serve = f"{line} --model-loader-extra-config '{json.dumps(LAX_EXTRA_CONFIG)}'" if line else None
    report.loads_with = {
        "load_format": PLUGIN_LOAD_FORMAT,
        "strict": False,
        "model_loader_extra_config": dict(LAX_EXTRA_CONFIG),
        "serve": serve,
    }
    files = len({f.file for f in missing})
    msg = (
        f"vLLM's --load-format sharded_state refuses this folder (ValueError 'Missing keys': {len(missing)} "
        f"key(s) in {files} file(s)); it loads only with {LAX_LOADER}, which logs them at WARNING and "
        "leaves them as initialised"
    )
    report.add("sharded-state", msg, code=0, warn=True)


def _check_vllm(report: Report, manifest: Manifest) -> None:
    """A warning when the vLLM installed here is outside the releases the folder is for."""
    report.vllm_versions = manifest.vllm_versions
    found = vllm_versions.installed_vllm()
    report.vllm_installed = f"{found[0]} {found[1]}" if found else None
    problem = vllm_versions.mismatch(report.vllm_versions, found)
    if problem:
        report.add("vllm-version", problem, code=0, warn=True)


def _fill_stats(st: dict) -> None:
    if st.get("hash_seconds"):
        st["hash_gb_per_s"] = round(st["hashed_bytes"] / st["hash_seconds"] / 1e9, 3)
    if st.get("deep_seconds"):
        st["deep_gb_per_s"] = round(st["compared_bytes"] / st["deep_seconds"] / 1e9, 3)
