"""Publishing into a bucket folder: one run at a time, vLLM's listing guarded, the manifest last.

S3 has no rename, so the local swap (reshard.publish) becomes a commit of open uploads:

1. `locked`: `prefix.reshard/lock.json` is created if absent (If-None-Match: *); another run's
   lock is refused, a dead one of this host's (its pid is gone) is taken over.
2. `recover`: a commit journal left by a run killed while publishing is finished (its uploads are
   still open on the store: completed, the manifest last); then every other open upload under the
   prefix is aborted (a run killed before publishing).
3. `check` (before anything is uploaded): the prefix is empty, or holds a reshard output and
   --overwrite is given; no other object there matches vLLM's rank-file patterns (vLLM lists the
   prefix without a delimiter, so `prefix/old/model-rank-0-part-0.safetensors` would be loaded too);
   no folder above holds an output (this one would be loaded with it); the output fits in the 1000
   keys vLLM's single listing call sees.
4. The rank files, side files and manifest are uploaded as open multipart uploads (reshard.store.upload):
   readers still see the previous output, or nothing.
5. `commit`, signals held: the journal is written; the previous manifest deleted (that output no
   longer verifies); every upload completed, several at once (new keys only if absent), each
   object's checksum as the store reports it compared with the one computed while uploading; the
   previous output's objects that the new one does not replace deleted; the manifest completed
   last; the journal deleted. A kill in this window leaves the journal: the next run (or
   `reshard save` again) finishes it. An error before it leaves the previous output as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from fnmatch import fnmatch

from reshard.errors import OutputError, ReshardError, UnsupportedError
from reshard.manifest import Manifest, parse_manifest
from reshard.names import BUCKET_JOURNAL, BUCKET_LOCK, MANIFEST, PIECE_MANIFEST_GLOB, is_rank_file_name
from reshard.publish import claim_checked, signals_held
from reshard.store.bucket import Bucket, Conflict
from reshard.store.upload import OpenUpload, Uploads

VLLM_MAX_KEYS = 1000  # vLLM lists the prefix with one list_objects_v2 call: its first page only
# what vLLM's runai_streamer_sharded matches against whole keys (fnmatch: `*` crosses "/")
VLLM_KEY_PATTERNS = ("*model-rank-*-part-*.safetensors", "*model-pp-*-tp-*-part-*.safetensors")
MAX_SMALL = 1 << 30  # bytes: a manifest, a lock or a journal read back
LOCK_BEAT = 30  # seconds: a running save rewrites its lock object this often
LOCK_STALE = 300  # seconds: a lock not rewritten for this long is a dead run's


@dataclass
class Prior:
    """What the prefix holds before this run: every key, and the previous output's manifest."""

    keys: set[str] = field(default_factory=set)
    manifest: Manifest | None = None

    def ours(self, bucket: Bucket) -> set[str]:
        """The keys a previous reshard run wrote (replaced or removed by --overwrite)."""
        named: set[str] = {MANIFEST}
        if self.manifest is not None:
            named |= {f.name for f in self.manifest.files} | {s.name for s in self.manifest.copied_files}
            named |= set(self.manifest.copied)
        out = set()
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
        self.recovered: str | None = None  # what `recover` finished, told to the user
        self.journaled = False  # the commit journal is written: the open uploads are the next run's to finish

    # ---- 1. one run at a time ------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, run_id: str) -> Iterator[None]:
        """Hold the prefix's lock object; it is rewritten every LOCK_BEAT seconds, so that a lock
        not rewritten for LOCK_STALE seconds (by the store's clock) is a dead run's, taken over."""
        body = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "run": run_id, "since": int(time.time())}
        ).encode()
        try:
            self.bucket.put(self.lock_key, body, create_only=True)
        except Conflict:
            self._take_dead_lock(body)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(LOCK_BEAT):
                with contextlib.suppress(Exception):
                    self.bucket.put(self.lock_key, body)

        beater = threading.Thread(target=beat, name="reshard-s3-lock", daemon=True)
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()
            with contextlib.suppress(Exception):
                self.bucket.delete([self.lock_key])

    def _lock_age(self) -> float | None:
        """Seconds since the lock object was last written, by the store's own clock."""
        head = self.bucket.head(self.lock_key)
        if head is None:
            return None
        with contextlib.suppress(Exception):
            now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
            return (now - head["LastModified"]).total_seconds()
        return None

    def _take_dead_lock(self, body: bytes) -> None:
        raw = self.bucket.get(self.lock_key, limit=MAX_SMALL)
        try:
            held = json.loads(raw or b"{}")
            host, pid, since = str(held["host"]), int(held["pid"]), int(held["since"])
        except (ValueError, KeyError, TypeError):
            host, pid, since = "?", 0, 0
        age = self._lock_age()
        dead = host == socket.gethostname() and pid and not _alive(pid)
        if dead or age is None or age > LOCK_STALE:
            self.bucket.delete([self.lock_key])
            try:
                self.bucket.put(self.lock_key, body, create_only=True)
                return
            except Conflict:
                pass
        if not pid:  # not what reshard writes there
            raise OutputError(
                f"s3://{self.url.bucket}/{self.lock_key} is not a reshard lock, yet it is where {self.url}'s lock "
                "goes (it is not taken over while it was written in the last "
                f"{LOCK_STALE // 60} minutes)",
                f"delete it if no reshard run is writing {self.url}, or wait",
            )
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "an unknown time"
        raise OutputError(
            f"another reshard run (host {host}, pid {pid}, since {when}) is writing {self.url}",
            f"wait for it: a run that died leaves a lock that is taken over {LOCK_STALE // 60} minutes after its "
            f"last sign of life (or delete s3://{self.url.bucket}/{self.lock_key})",
        )

    # ---- 2. what interrupted runs left ---------------------------------------------------------

    def recover(self) -> None:
        """Finish an interrupted commit (its journal), then abort every other open upload."""
        raw = self.bucket.get(self.journal_key, limit=MAX_SMALL)
        if raw is not None:
            journal = json.loads(raw)
            self._finish(journal)
            self.recovered = f"finished publishing the output of interrupted run {journal.get('run', '?')}"
        for prefix in (self.url.prefix, self.url.work):
            for key, upload_id in self.bucket.open_uploads(prefix):
                self.bucket.abort(key, upload_id)

    def _finish(self, journal: dict) -> None:
        manifest = OpenUpload.from_json(journal["manifest"])
        if not self._open(manifest):  # the manifest was completed: only the journal is left
            self.bucket.delete([self.journal_key])
            return
        uploads = Uploads(self.bucket)
        try:
            if journal.get("drop_manifest"):
                self.bucket.delete([self.url.key(MANIFEST)])
            ups = [OpenUpload.from_json(obj) for obj in journal["uploads"]]
            # those completed before the interrupt are left; asked and completed several at once, as
            # the run's own commit does (two round trips a file, hundreds of files for a large model)
            still = [up for up, is_open in zip(ups, uploads.pool.map(self._open, ups), strict=True) if is_open]
            uploads.complete_all(still, create_only=lambda up: False)
            self.bucket.delete(list(journal["remove"]))
            uploads.complete(manifest, create_only=False)
            self.bucket.delete([self.journal_key])
        finally:
            uploads.close()

    def _open(self, up: OpenUpload) -> bool:
        return self.bucket.parts(up.key, up.upload_id) is not None

    # ---- 3. before anything is uploaded --------------------------------------------------------

    def check(self, *, overwrite: bool, new_names: list[str], rank_bytes: list[int], max_part: int) -> Prior:
        """Refuse a prefix that is not ours to write (see the module docstring); what it holds."""
        for parent in self.url.parents():
            if self.bucket.head(parent.key(MANIFEST)) is not None:
                raise UnsupportedError(
                    f"{parent} holds a reshard output, and {self.url} lies inside it: vLLM would load this "
                    f"output's rank files with that one's",
                    "write to a prefix outside any other output's",
                )
        prior = Prior(keys={o.key for o in self.bucket.list()})
        raw = self.bucket.get(self.url.key(MANIFEST), limit=MAX_SMALL)
        if raw is not None:
            prior.manifest = parse_manifest(raw, str(self.url) + MANIFEST)
        ours = prior.ours(self.bucket)
        foreign = sorted(prior.keys - ours)
        for key in foreign:  # before "not empty": --overwrite would not remove it
            if any(fnmatch(key, p) for p in VLLM_KEY_PATTERNS):
                raise UnsupportedError(
                    f"s3://{self.url.bucket}/{key} lies under {self.url}: vLLM lists the prefix without a "
                    f"delimiter and would load it with this output's rank files",
                    "move or delete it, or write to another prefix",
                )
        if prior.keys and not overwrite:
            if self.recovered and prior.manifest is not None:  # this rerun's first act: that output is whole now
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

    # ---- 5. the commit -------------------------------------------------------------------------

    def commit(self, uploads: Uploads, files: list[OpenUpload], manifest: OpenUpload, prior: Prior, run: str) -> None:
        new = {up.key for up in files} | {manifest.key}
        remove = sorted(prior.ours(self.bucket) - new)
        journal = {
            "run": run,
            "drop_manifest": prior.manifest is not None or self.url.key(MANIFEST) in prior.keys,
            "uploads": [up.to_json() for up in files],
            "remove": remove,
            "manifest": manifest.to_json(),
        }
        with signals_held():
            self.bucket.put(self.journal_key, json.dumps(journal).encode())
            self.journaled = True
            try:
                if journal["drop_manifest"]:
                    self.bucket.delete([self.url.key(MANIFEST)])
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
