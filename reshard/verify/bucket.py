"""What only a bucket folder (`verify s3://bucket/prefix/`) can get wrong, beside the checks every
folder gets (structure, keys, checksums; read through `reshard.store.view.BucketView`).

- vLLM's listing: `runai_streamer_sharded` lists the prefix with one list_objects_v2 call, no
  delimiter: over 1000 keys it misses files, and a rank-file pattern matches nested keys too
  (`prefix/old/model-rank-0-part-0.safetensors`), so such a key, or a nested output, is an error;
  so is an output in a folder above (its listing would take this one's files).
- an interrupted publish: reshard's commit journal beside the prefix (`prefix.reshard/`).
- the store's checksums: every object's SHA256 as the store reports it (HEAD, ChecksumMode=ENABLED)
  against the one the manifest recorded when reshard uploaded it (`store_sha256`): an object
  replaced after the save fails without a byte of it read. `--deep` hashes every byte instead; so does
  verify itself, said in a note, for the objects the store cannot vouch for (it reports no checksum, or
  the manifest recorded none) where the manifest has digests to hash them against.
"""

from __future__ import annotations

import concurrent.futures as cf
from fnmatch import fnmatchcase

from reshard import settings
from reshard.errors import ReshardError
from reshard.hashing import NONE
from reshard.names import BUCKET_JOURNAL, MANIFEST
from reshard.store.publish import VLLM_KEY_PATTERNS, VLLM_MAX_KEYS
from reshard.store.view import BucketView, unvouched
from reshard.verify.report import CORRUPT, RERUN, Report
from reshard.verify.structure import Folder


def check_listing(report: Report, view: BucketView) -> None:
    """vLLM's single listing call sees every file, and only this output's."""
    url = view.url
    keys = len(view.listing)
    if keys > VLLM_MAX_KEYS:
        msg = (
            f"{url} holds {keys} objects: vLLM's runai_streamer_sharded lists only the first {VLLM_MAX_KEYS} "
            "keys under a prefix and would miss rank files (move the other objects out, or re-save with a "
            "larger --max-part-size)"
        )
        report.add("listing", msg, code=CORRUPT)
    for name in view.names():
        if "/" not in name:
            continue
        if name.rsplit("/", 1)[-1] == MANIFEST:
            msg = f"{name}: another reshard output lies inside this one: vLLM would load its rank files with these"
            report.add("nested", msg, code=CORRUPT, file=name)
        elif any(fnmatchcase(view.url.key(name), p) for p in VLLM_KEY_PATTERNS):
            msg = (
                f"{name} lies under {url}: vLLM lists the prefix without a delimiter and would load it with "
                "this output's rank files (KeyError at load): move or delete it"
            )
            report.add("stray", msg, code=CORRUPT, file=name)
    for parent in url.parents():
        if view.bucket.head(parent.key(MANIFEST)) is not None:
            msg = f"{parent} holds a reshard output, and {url} lies inside it: vLLM would load both outputs' files"
            report.add("nested", msg, code=CORRUPT)
    if view.bucket.head(url.work + BUCKET_JOURNAL) is not None:
        msg = (
            f"{url.work}{BUCKET_JOURNAL}: a publish of this prefix was interrupted; run the same "
            "`reshard save ... --overwrite` again to finish it"
        )
        report.add("leftover", msg, code=CORRUPT, warn=True)


def check_store_sums(report: Report, folder: Folder, view: BucketView, *, deep: bool) -> list[str]:
    """Each object's checksum as the store reports it against the manifest's `store_sha256`.

    Returns the objects verify must hash itself: every one with `deep`; else those the store cannot
    vouch for where the manifest has digests to hash them against (none recorded in the manifest, none
    reported by the store: copied elsewhere, a proxy that strips them), with one note saying so (the
    caller prints it: `report.notes`). Nothing to hash against (--checksum none): a warning instead."""
    manifest = folder.manifest
    assert manifest is not None
    present = [f.name for f in folder.files if f.size is not None] + [
        s.name for s in manifest.copied_files if view.exists(s.name)
    ]
    recorded = manifest.store_sha256
    got: dict[str, object] = {}
    if recorded:
        with cf.ThreadPoolExecutor(settings.S3_CONCURRENCY.get(), thread_name_prefix="reshard-head") as pool:
            got = dict(zip(present, pool.map(lambda n: _head(view, n), present), strict=True))
    names, why = unvouched(present, recorded, got)
    if not recorded or (got and all(h is None for h in got.values())):  # none vouched for
        return _unvouched(report, folder, present, names, why, deep=deep)
    report.checked.append("store-checksums")
    for name, have in got.items():
        want = recorded.get(name)
        if want is None:
            continue  # hashed instead (below)
        elif isinstance(have, Exception):
            err = have.strerror if isinstance(have, OSError) else have
            report.add("store-checksum", f"{name}: cannot read its metadata ({err})", code=CORRUPT, file=name)
        elif have != want:
            said = f"checksum {have}" if have else "no SHA256 (uploaded by something else)"
            msg = (
                f"{name}: the store reports {said}, the manifest {want}: the object was replaced after it "
                f"was written ({RERUN})"
            )
            report.add("store-checksum", msg, code=CORRUPT, file=name)
    report.stats["store_checksums_checked"] = len(got) - len(names)
    return _unvouched(report, folder, present, names, why, deep=deep)


def _unvouched(
    report: Report, folder: Folder, present: list[str], names: list[str], why: str, *, deep: bool
) -> list[str]:
    """What to hash of the objects `present`, `names` of which the store's checksums did not vouch for."""
    if deep:
        return present
    if not names:
        return []
    if folder.checksum == NONE:
        msg = (
            f"{why}, and the manifest records no digests (saved with --checksum none): contents of "
            f"{_some(names)} not checked; sizes and headers were"
        )
        report.add("store-checksum", msg, code=0, warn=True)
        return []
    report.stats["store_checksums_missing"] = len(names)
    report.notes.append(
        f"{why}: hashing {_some(names)} against the manifest's {folder.checksum} digests instead, as --deep does"
    )
    return names


def _some(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} objects"


def _head(view: BucketView, name: str) -> str | Exception | None:
    try:
        return view.store_sha256(name)
    except (FileNotFoundError, ReshardError) as e:
        return e
