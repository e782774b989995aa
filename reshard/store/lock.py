"""The lock object of an s3:// output: one run per prefix (`prefix.reshard/lock.json`, beside the prefix,
never under it: vLLM lists the prefix whole).

The lock is created if absent (If-None-Match: *) and rewritten every LOCK_BEAT seconds while the run
lasts; another run's lock is refused (naming its host and pid), a lock of this host whose process is
gone, or one nobody rewrote for LOCK_STALE seconds by the store's clock (a killed CI job), is taken over.
A run deletes its lock, and a dead one, with If-Match its ETag: never a lock taken since. A lock a
run could not delete (the store failing past botocore's retries during its cleanup) is said in a note,
with the command that deletes it; a run it refuses is told how long ago that lock was last rewritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime

from reshard.console import note
from reshard.errors import OutputError, ReshardError
from reshard.store.bucket import Bucket, Conflict

MAX_SMALL = 1 << 30  # bytes: a manifest, a lock or a journal read back
LOCK_BEAT = 30  # seconds: a running save rewrites its lock object this often
LOCK_STALE = 300  # seconds: a lock not rewritten for this long is a dead run's


class PrefixLock:
    """The lock object `lock_key` of the output at `bucket.url`."""

    def __init__(self, bucket: Bucket, lock_key: str) -> None:
        self.bucket = bucket
        self.url = bucket.url
        self.lock_key = lock_key

    @contextlib.contextmanager
    def held(self, run_id: str) -> Iterator[None]:
        """Hold the prefix's lock object; it is rewritten every LOCK_BEAT seconds, so that a lock
        not rewritten for LOCK_STALE seconds (by the store's clock) is a dead run's, taken over."""
        body = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "run": run_id, "since": int(time.time())}
        ).encode()
        try:
            etag = self.bucket.put(self.lock_key, body, create_only=True)
        except Conflict:
            etag = self._take_dead_lock(body)
        stop = threading.Event()

        def beat() -> None:
            nonlocal etag
            while not stop.wait(LOCK_BEAT):
                with contextlib.suppress(Exception):
                    etag = self.bucket.put(self.lock_key, body)

        beater = threading.Thread(target=beat, name="reshard-s3-lock", daemon=True)
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()
            self._release(etag)

    def _release(self, etag: str) -> None:
        """Delete our lock: ours only (If-Match), so that a delayed delete cannot free another run's. botocore
        retries the request (RESHARD_S3_RETRIES, with backoff: a dropped connection, throttling, 5xx); a lock
        still there after that is said on stderr, with what it costs and how to remove it. The run's outcome
        stands: its output is published (or not) whatever becomes of the lock."""
        try:
            self.bucket.delete_if(self.lock_key, etag)
            return
        except Exception as e:
            why = e.message if isinstance(e, ReshardError) else (str(e) or type(e).__name__)
        where = f"s3://{self.url.bucket}/{self.lock_key}"
        note(  # stderr closed: the lock goes stale all the same
            f"this run's lock {where} could not be deleted ({' '.join(str(why).split())}): a save to {self.url} "
            f"from another host is refused until it is {LOCK_STALE // 60} minutes old (one from this host takes it "
            f"over); delete it if no reshard run is writing there: aws s3 rm {where}"
        )

    def _lock_age(self) -> tuple[float | None, str]:
        """Seconds since the lock object was last written, by the store's own clock (None if unknown), and its
        ETag ("" if it is gone)."""
        head = self.bucket.head(self.lock_key)
        if head is None:
            return None, ""
        etag = str(head.get("ETag", ""))
        with contextlib.suppress(Exception):
            now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
            return (now - head["LastModified"]).total_seconds(), etag
        return None, etag

    def _take_dead_lock(self, body: bytes) -> str:
        """Take over a dead run's lock (the ETag of ours), else say whose it is."""
        host, pid, since = _lock_fields(self.bucket.get(self.lock_key, limit=MAX_SMALL))
        age, etag = self._lock_age()
        dead = host == socket.gethostname() and pid and not _alive(pid)
        # that lock only (If-Match): another run taking it over at the same time keeps its own
        if (dead or age is None or age > LOCK_STALE) and self.bucket.delete_if(self.lock_key, etag):
            try:
                return self.bucket.put(self.lock_key, body, create_only=True)
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
        # how long ago the run last rewrote its lock tells a live run (under LOCK_BEAT) from one that is gone
        # but could not delete it (a store error during its cleanup): the user decides whether to wait
        seen = (
            f"; its lock was last rewritten {_span(age)} ago, every {LOCK_BEAT} s while it runs"
            if age is not None
            else ""
        )
        left = f", in {_span(LOCK_STALE - age)}" if age is not None and 0 <= age <= LOCK_STALE else ""
        raise OutputError(
            f"another reshard run (host {host}, pid {pid}, since {when}) is writing {self.url}{seen}",
            f"wait for it: a run that died leaves a lock that is taken over {LOCK_STALE // 60} minutes after its "
            f"last sign of life{left} (or delete s3://{self.url.bucket}/{self.lock_key})",
        )


def _lock_fields(raw: bytes | None) -> tuple[str, int, int]:
    """(host, pid, since) of a lock reshard wrote; ("?", 0, 0) for anything else (a pid or time out of
    range too: `os.kill` and `localtime` would overflow on them)."""
    try:
        held = json.loads(raw or b"{}")
        host, pid, since = str(held["host"]), int(held["pid"]), int(held["since"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return "?", 0, 0
    if not (0 < pid < 1 << 31 and 0 <= since < 1 << 40):
        return "?", 0, 0
    return host, pid, since


def _span(seconds: float) -> str:
    """'4 min 5 s', '40 s'."""
    m, s = divmod(max(0, round(seconds)), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
