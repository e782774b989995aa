"""Publishing into a bucket folder: one run at a time, vLLM's listing guarded, the manifest last.

S3 has no rename, so the local swap (reshard.publish) becomes a commit of open uploads:

1. `locked`: `prefix.reshard/lock.json` is created if absent (If-None-Match: *); another run's
   lock is refused, a dead one of this host's (its pid is gone) is taken over.
2. `recover`: a commit journal left by a run killed while publishing is finished (its uploads are
   still open on the store: completed, the manifest last), where every object it names is still an
   open upload or completed; one it cannot finish is dropped, its objects left without a manifest.
3. `check` (before anything is uploaded): the prefix is empty, or holds a reshard output and
   --overwrite is given; no other object there matches vLLM's rank-file patterns (vLLM lists the
   prefix without a delimiter, so `prefix/old/model-rank-0-part-0.safetensors` would be loaded too);
   no folder above holds an output (this one would be loaded with it); the output fits in the 1000
   keys vLLM's single listing call sees. Then `abort_leftovers`: the open uploads a killed run of this
   output left are aborted (not those of an output nested under the prefix: its own lock marks it).
4. The rank files, side files and manifest are uploaded as open multipart uploads (reshard.store.upload):
   readers still see the previous output, or nothing.
5. `commit`, signals held: the journal is written; the previous manifest deleted, If-Match the ETag
   `check` listed (that output no longer verifies; a delayed DELETE cannot land on the new manifest);
   every upload completed, several at once (new keys only if absent), each object's checksum as the
   store reports it compared with the one computed while uploading; the previous output's objects
   that the new one does not replace deleted; the manifest completed last; the journal deleted. A kill
   in this window leaves the journal: the next run (or `reshard save` again) finishes it. An error
   before it leaves the previous output as it was. Just before it, the prefix's nesting is checked
   again (an output published above or below it meanwhile, by a run under its own lock).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from fnmatch import fnmatch

from reshard.errors import OutputError, ReshardError, UnsupportedError
from reshard.manifest import Manifest, parse_manifest
from reshard.names import (
    BUCKET_JOURNAL,
    BUCKET_LOCK,
    BUCKET_WORK_SUFFIX,
    MANIFEST,
    PIECE_MANIFEST_GLOB,
    is_rank_file_name,
)
from reshard.publish import claim_checked, signals_held
from reshard.store.bucket import Bucket
from reshard.store.journal import Journal, read_journal
from reshard.store.lock import MAX_SMALL, PrefixLock
from reshard.store.upload import OpenUpload, Uploads

VLLM_MAX_KEYS = 1000  # vLLM lists the prefix with one list_objects_v2 call: its first page only
# what vLLM's runai_streamer_sharded matches against whole keys (fnmatch: `*` crosses "/")
VLLM_KEY_PATTERNS = ("*model-rank-*-part-*.safetensors", "*model-pp-*-tp-*-part-*.safetensors")


@dataclass
class Prior:
    """What the prefix holds before this run: every key, and the previous output's manifest."""

    keys: set[str] = field(default_factory=set)
    manifest: Manifest | None = None
    manifest_etag: str = ""  # the ETag of the manifest object there, the only one the commit deletes

    def ours(self, bucket: Bucket) -> set[str]:
        """The keys a previous reshard run wrote (replaced or removed by --overwrite)."""
        named: set[str] = {MANIFEST}
        if self.manifest is not None:
            named |= {f.name for f in self.manifest.files} | {s.name for s in self.manifest.copied_files}
            named |= set(self.manifest.copied)
        # the previous output's own files, listed or not (a listing that lags must not leave them behind)
        out = {bucket.url.key(n) for n in named if self.manifest is not None and n != MANIFEST}
        for key in self.keys:
            name = bucket.url.name(key)
            top = "/" not in name
            if name in named or (top and (is_rank_file_name(name) or fnmatch(name, PIECE_MANIFEST_GLOB))):
                out.add(key)
        return out


class BucketPublisher:
    """The publish sequence of one `s3://bucket/prefix/` output (see the module docstring)."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.url = bucket.url
        self.lock_key = self.url.work + BUCKET_LOCK
        self.journal_key = self.url.work + BUCKET_JOURNAL
        self.recovered: str | None = None  # what `recover` found and did, told to the user
        self.finished: str | None = None  # the interrupted run whose output `recover` published
        self.journaled = False  # the commit journal is written: the open uploads are the next run's to finish

    # ---- 1. one run at a time ------------------------------------------------------------------

    def locked(self, run_id: str) -> contextlib.AbstractContextManager[None]:
        """Hold the prefix's lock object (reshard.store.lock)."""
        return PrefixLock(self.bucket, self.lock_key).held(run_id)

    # ---- 2. what interrupted runs left ---------------------------------------------------------

    def recover(self) -> None:
        """Finish an interrupted commit (its journal), where every object it names is still there."""
        raw = self.bucket.get(self.journal_key, limit=MAX_SMALL)
        if raw is None:
            return
        journal = read_journal(raw, self.url, self.journal_key)
        lost = self._finish(journal)
        if lost is None:
            self.finished = journal.run
            self.recovered = f"finished publishing the output of interrupted run {journal.run}"
        else:
            self.recovered = (
                f"could not finish publishing the output of interrupted run {journal.run}: {lost}; its journal "
                "is dropped, and what it had completed is left without a manifest"
            )

    def _finish(self, journal: Journal) -> str | None:
        """Complete the journal's uploads still open, the manifest last; None, or why it cannot be done (an
        upload the store no longer has, nor its object: aborted outside reshard, e.g. by a lifecycle rule),
        and then nothing is completed and the journal is dropped."""
        uploads = Uploads(self.bucket)
        try:
            if not self._open(journal.manifest) and self._there(journal.manifest):
                self.bucket.delete([self.journal_key])  # the commit's last step was done: only the journal is left
                return None
            ups = [*journal.uploads, journal.manifest]
            # asked several at once, as the run's own commit does (hundreds of files for a large model)
            is_open = list(uploads.pool.map(self._open, ups))
            closed = [up for up, o in zip(ups, is_open, strict=True) if not o]
            there = list(uploads.pool.map(self._there, closed))
            gone = [up for up, t in zip(closed, there, strict=True) if not t]
            if gone:
                uploads.open.update({up.key: up for up, o in zip(ups, is_open, strict=True) if o})
                uploads.abort_all()
                self.bucket.delete([self.journal_key])
                return f"{self.url.name(gone[0].key)} is neither an open upload nor an object of that run"
            if journal.drop_manifest and not self.bucket.delete_if(self.url.key(MANIFEST), journal.manifest_etag):
                uploads.open.update({up.key: up for up, o in zip(ups, is_open, strict=True) if o})
                uploads.abort_all()
                self.bucket.delete([self.journal_key])
                return f"{MANIFEST} there is not the one that run withdrew"
            still = [up for up, o in zip(journal.uploads, is_open[:-1], strict=True) if o]
            uploads.complete_all(still, create_only=lambda up: False)
            self.bucket.delete(journal.remove)
            uploads.complete(journal.manifest, create_only=False)
            self.bucket.delete([self.journal_key])
            return None
        finally:
            uploads.close()

    def _open(self, up: OpenUpload) -> bool:
        return self.bucket.parts(up.key, up.upload_id) is not None

    def _there(self, up: OpenUpload) -> bool:
        """`up` was completed: its key holds an object of its checksum (or, from a store that reports
        none, of its size)."""
        head = self.bucket.head(up.key)
        if head is None:
            return False
        reported = head.get("ChecksumSHA256")
        return reported == up.checksum() if reported else head.get("ContentLength") == up.size

    def abort_leftovers(self, prior: Prior) -> None:
        """Abort the open uploads a killed run of this output left under the prefix (after `check`: a refused
        run touches nothing), not those of another output nested in it, whose lock or journal sits in its
        own `.reshard/` folder under this prefix."""
        marker = BUCKET_WORK_SUFFIX + "/"
        nested = tuple(
            self.url.prefix + name[: name.index(marker)] + "/"
            for name in (self.url.name(k) for k in prior.keys)
            if marker in name
        )
        for key, upload_id in self.bucket.open_uploads(self.url.prefix):
            if not key.startswith(nested):
                self.bucket.abort(key, upload_id)

    # ---- 3. before anything is uploaded --------------------------------------------------------

    def check(self, *, overwrite: bool, new_names: list[str], rank_bytes: list[int], max_part: int) -> Prior:
        """Refuse a prefix that is not ours to write (see the module docstring); what it holds."""
        work = [p for p in self.url.prefix.split("/") if p.endswith(BUCKET_WORK_SUFFIX)]
        if work:
            raise UnsupportedError(
                f"{self.url}: {work[0]}/ is where reshard keeps the lock and commit journal of "
                f"{work[0][: -len(BUCKET_WORK_SUFFIX)]}/, an output beside it",
                f"choose a prefix without a part ending in {BUCKET_WORK_SUFFIX}",
            )
        self._check_parents()
        listed = {o.key: o.etag for o in self.bucket.list()}
        key = self.url.key(MANIFEST)
        head = self.bucket.head(key)  # asked for itself: a listing that lags (or lies) would withdraw it unasked
        if head is not None and key not in listed:
            raise OutputError(
                f"{self.url}{MANIFEST} is there, yet the store's listing of {self.url} does not show it: the "
                "listing is out of step with the objects",
                "retry later; if it persists, the store (or a proxy in front of it) serves a stale listing",
            )
        prior = Prior(keys=set(listed), manifest_etag=str(head.get("ETag", "")) if head else "")
        raw = self.bucket.get(key, limit=MAX_SMALL) if head is not None else None
        if raw is not None:
            prior.manifest = parse_manifest(raw, str(self.url) + MANIFEST)
        ours = prior.ours(self.bucket)
        foreign = sorted(prior.keys - ours)
        self._check_foreign(foreign)  # before "not empty": --overwrite would not remove it
        if prior.keys and not overwrite:
            if self.finished and prior.manifest is not None:  # this rerun's first act: that output is whole now
                raise OutputError(
                    f"{self.url} holds the output of run {prior.manifest.run_id}, whose publishing this run "
                    "has just finished",
                    "`reshard verify` it; pass --overwrite to replace it",
                )
            raise OutputError(
                f"{self.url} is not empty ({len(prior.keys)} objects"
                + (", a reshard output)" if prior.manifest else ")"),
                "pass --overwrite to replace the reshard output there, or choose another prefix",
            )
        total = len(foreign) + len(new_names) + 1
        if total > VLLM_MAX_KEYS:
            rank_files = sum(is_rank_file_name(n) for n in new_names)
            room = (VLLM_MAX_KEYS - (total - rank_files)) // max(1, len(rank_bytes))  # rank files per rank
            need = max(rank_bytes, default=0)
            raise UnsupportedError(
                f"{self.url} would hold {total} objects; vLLM's runai_streamer_sharded lists only the first "
                f"{VLLM_MAX_KEYS} keys under a prefix and would miss rank files",
                _fit_hint(need, room, max_part, len(foreign)),
            )
        return prior

    def _check_parents(self) -> None:
        for parent in self.url.parents():
            if self.bucket.head(parent.key(MANIFEST)) is not None:
                raise UnsupportedError(
                    f"{parent} holds a reshard output, and {self.url} lies inside it: vLLM would load this "
                    f"output's rank files with that one's",
                    "write to a prefix outside any other output's",
                )

    def _check_foreign(self, keys: list[str]) -> None:
        for key in keys:
            if any(fnmatch(key, p) for p in VLLM_KEY_PATTERNS):
                raise UnsupportedError(
                    f"s3://{self.url.bucket}/{key} lies under {self.url}: vLLM lists the prefix without a "
                    f"delimiter and would load it with this output's rank files",
                    "move or delete it, or write to another prefix",
                )

    # ---- 5. the commit -------------------------------------------------------------------------

    def commit(self, uploads: Uploads, files: list[OpenUpload], manifest: OpenUpload, prior: Prior, run: str) -> None:
        new = {up.key for up in files} | {manifest.key}
        remove = sorted(prior.ours(self.bucket) - new)
        journal = {
            "run": run,
            "drop_manifest": prior.manifest is not None or self.url.key(MANIFEST) in prior.keys,
            "manifest_etag": prior.manifest_etag,
            "uploads": [up.to_json() for up in files],
            "remove": remove,
            "manifest": manifest.to_json(),
        }
        # again: a run on a prefix above or below this one (its own lock, so not this one's) may have
        # published while this one uploaded; either way vLLM would load the two outputs together
        self._check_parents()
        self._check_foreign(sorted({o.key for o in self.bucket.list()} - prior.ours(self.bucket) - new))
        with signals_held():
            self.bucket.put(self.journal_key, json.dumps(journal).encode())
            self.journaled = True
            if journal["drop_manifest"] and not self.bucket.delete_if(self.url.key(MANIFEST), prior.manifest_etag):
                self.bucket.delete([self.journal_key])
                self.journaled = False  # nothing was completed: the uploads are aborted
                raise OutputError(
                    f"{self.url}{MANIFEST} changed while this run uploaded: another writer published there",
                    f"nothing of this run was published; `reshard verify {self.url}`, and save again if needed",
                )
            try:
                uploads.complete_all(files, create_only=lambda up: up.key not in prior.keys)
                self.bucket.delete(remove)
                uploads.complete(manifest, create_only=True)
            except ReshardError as e:  # the journal stays: say who finishes the commit
                raise type(e)(
                    f"{e.message}; publishing stopped half-way (the previous output, if any, is already "
                    "withdrawn), and its journal is kept",
                    f"{e.hint + '; then ' if e.hint else ''}rerun `reshard save` to {self.url}: it first "
                    "finishes publishing this run's output from the uploads left open",
                ) from e
            claim_checked(f"{self.url} holds this run's new output, complete", lambda: self._holds(run))
            self.bucket.delete([self.journal_key])

    def _holds(self, run: str) -> bool:
        """The prefix's manifest is this run's."""
        raw = self.bucket.get(self.url.key(MANIFEST), limit=MAX_SMALL)
        return raw is not None and parse_manifest(raw, str(self.url)).run_id == run


def _fit_hint(rank_bytes: int, room: int, max_part: int, foreign: int) -> str:
    others = f"; or move the {foreign} other objects out of the prefix" if foreign else ""
    if room < 1:
        return f"write to a prefix with fewer other objects{others}"
    fit = -(-rank_bytes // room)
    gib = -(-fit // (1 << 30))
    if gib * (1 << 30) <= max_part:
        return f"use fewer, larger files{others}"
    return f"pass --max-part-size {gib}GiB (at most {room} files per rank){others}"
