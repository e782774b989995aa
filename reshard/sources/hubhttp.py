"""One Hub repo at one commit, over HTTP: model info, and byte ranges of its files (small ones whole).

Requests to the Hub go through huggingface_hub's own HTTP client (`get_session`), headers
(`build_hf_headers`: HF_TOKEN, user agent) and endpoint (HF_ENDPOINT); the ranges of a file the Hub
redirected to its CDN are read from the socket straight into the buffer (reshard.sources.rawhttp)
where that client would connect directly too (no proxy, its default factory). The revision asked
for is resolved to its commit once (`HfApi.model_info`) and every later URL names that commit, so a
branch that moves during the run cannot mix two commits' files.

Failures a user can act on (401/403 gated or private, 404 repo, revision or file) raise SourceError at
once, and so does a host that cannot be reached at all (its name does not resolve, the connection is
refused: `Unreachable`, so that a cached commit is used at once); the rest (dropped connections,
timeouts, 5xx and 429, answers that are not HTTP, short bodies, a wrong Content-Range, a body slower
than RESHARD_HUB_MIN_SPEED) are retried with exponential backoff, each retry said on stderr, resuming a
range where its body stopped, and raise SourceError once RESHARD_HUB_RETRIES attempts in a row made no
progress (a body ended for being too slow counts as none, whatever it brought).

Every answer for a file must be of one version (`HubRepo._pin`): the Hub's linked ETag is the LFS
sha256 the commit holds, and the ETag and Content-Range total of each answer are those of the first
(later requests send If-Match): a CDN that serves other bytes is a SourceError at once, not retried.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote, urlparse

import numpy as np

from reshard import settings
from reshard.console import log_line
from reshard.errors import SourceError
from reshard.io.writer import NUMPY_COPY
from reshard.sources import rawhttp

_RECV: int | None = None
T = TypeVar("T")


class Unreachable(SourceError):
    """Retries ran out: the Hub (or its CDN) did not answer usably."""


class Transient(Exception):
    """Worth another try: the connection or the answer failed, not the request."""


class TooSlow(Transient):
    """A body slower than RESHARD_HUB_MIN_SPEED (a stalled or slow-loris server): retried, no progress."""


def _refused(e: BaseException) -> bool:
    """The host cannot be reached at all: its name does not resolve, or nothing listens. Waiting
    does not mend either, so they are not retried."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (socket.gaierror, ConnectionRefusedError)):
            return True
        text = str(cur)
        if "Name or service not known" in text or "Connection refused" in text or "nodename nor servname" in text:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def deadline(nbytes: int) -> float:
    """When a request for `nbytes` must be done (time.monotonic): one RESHARD_HUB_TIMEOUT to start,
    then at least RESHARD_HUB_MIN_SPEED bytes per second (0: no floor)."""
    speed = settings.HUB_MIN_SPEED.get()
    return time.monotonic() + settings.HUB_TIMEOUT.get() + (nbytes / speed if speed else float("inf"))


class Meter:
    """Bytes downloaded so far (thread-safe), for the progress display."""

    def __init__(self) -> None:
        self.done = 0
        self.total = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n


@dataclass
class Remote:
    """What a range answer says about its file: size, blob ETag (as the cache names blobs)."""

    size: int
    etag: str | None


def hub_error(repo_id: str, e: BaseException, what: str = "") -> SourceError:
    """The one-line error for a Hub answer a user must act on."""
    from huggingface_hub import errors as he

    where = f"{repo_id}{'/' + what if what else ''}"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, he.GatedRepoError) or status == 403:
        return SourceError(
            f"{repo_id}: access denied (HTTP {status or 403}, gated or private repo)",
            "accept its terms on the Hub and set HF_TOKEN to a token of an account with access",
        )
    if isinstance(e, he.RevisionNotFoundError):
        return SourceError(f"{where}: revision not found on the Hub", "check --revision")
    if isinstance(e, he.EntryNotFoundError):
        return SourceError(f"{where}: file not found on the Hub", "check the repo and --revision")
    if what and status == 404 and not isinstance(e, he.RepositoryNotFoundError):  # the repo listed it: its CDN
        return SourceError(
            f"{where}: not found (HTTP 404), though the commit lists it",
            "the Hub or its CDN cannot serve the file now: run again later, or check HF_ENDPOINT",
        )
    if isinstance(e, he.RepositoryNotFoundError) or status in (401, 404):
        return SourceError(
            f"{repo_id}: repository not found on the Hub (HTTP {status or 404}), or private",
            "check the repo id; for a private or gated repo set HF_TOKEN",
        )
    return SourceError(f"{where}: the Hub answered {type(e).__name__} ({str(e).splitlines()[0][:160]})")


def with_retries(call: Callable[[], T], what: str, *, progress: Callable[[], int] | None = None) -> T:
    """`call()` retried with backoff on transient failures; `progress()` (bytes so far) resets the count."""
    import httpx2
    from huggingface_hub import errors as he

    failures, seen = 0, progress() if progress else 0
    while True:
        try:
            return call()
        except SourceError:
            raise
        except he.HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            if status is None or not (status >= 500 or status in (408, 429)):
                raise
            err: BaseException = e
        except (Transient, httpx2.HTTPError, OSError, ValueError) as e:
            err = e
        msg = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        if _refused(err):
            raise Unreachable(
                f"{what}: cannot reach the Hub ({type(err).__name__}: {msg})",
                "check the network or HF_ENDPOINT; a revision complete in the HF cache is used without the Hub",
            ) from err
        now = progress() if progress else 0
        failures = 1 if now > seen and not isinstance(err, TooSlow) else failures + 1
        seen = now
        retries = settings.HUB_RETRIES.get()
        if failures > retries:
            raise Unreachable(
                f"{what}: the download failed {failures} times in a row ({type(err).__name__}: {msg})",
                "check the network or HF_ENDPOINT and run again: a save without --stream resumes where it stopped, "
                "from what it kept in the HF cache",
            ) from err
        wait = min(30.0, settings.HUB_BACKOFF.get() * 2 ** (failures - 1))
        log_line(f"reshard: retrying in {wait:g} s ({failures}/{retries}): {what}: {type(err).__name__}: {msg}")
        time.sleep(wait)


class HubRepo:
    """`repo_id` pinned to the commit that `revision` names now."""

    def __init__(self, repo_id: str, revision: str | None) -> None:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.utils import build_hf_headers, get_session

        self.repo_id = repo_id
        self.revision = revision or "main"
        self.endpoint = constants.ENDPOINT
        self.session = get_session()
        self.headers = build_hf_headers()
        self.meter = Meter()
        self.urls: dict[str, str] = {}  # file -> where its bytes were last served from (the CDN)
        self.pins: dict[str, tuple[str | None, int]] = {}  # file -> (the CDN's ETag, total size) first served
        self.lock = threading.Lock()
        # the CDN's ranges read straight into the buffers, where huggingface_hub's client would go direct too
        self.raw = rawhttp.Pool() if rawhttp.usable() else None
        api = HfApi(endpoint=self.endpoint)
        try:
            info = with_retries(
                # with RESHARD_HUB_TIMEOUT: huggingface_hub's default is none, and a stalled Hub hung the run
                lambda: api.model_info(
                    repo_id, revision=revision, files_metadata=True, timeout=settings.HUB_TIMEOUT.get()
                ),
                f"{repo_id}: model info",
            )
        except SourceError:
            raise
        except Exception as e:  # an answer the user must act on
            raise hub_error(repo_id, e) from e
        if not info.sha:
            raise SourceError(f"{repo_id}: the Hub did not say which commit {self.revision} is")
        self.commit: str = info.sha
        self.files: list[str] = [s.rfilename for s in info.siblings or []]
        # the LFS sha256 the commit holds for each large file: what its bytes must hash to
        self.lfs: dict[str, str] = {
            s.rfilename: str(s.lfs.sha256).lower() for s in info.siblings or [] if s.lfs and s.lfs.sha256
        }
        # every file's size and git blob id (a small file's bytes hash to it, reshard.sources.hubsmall)
        self.sizes: dict[str, int] = {
            s.rfilename: s.size for s in info.siblings or [] if isinstance(s.size, int) and s.size >= 0
        }
        self.blob_ids: dict[str, str] = {s.rfilename: str(s.blob_id) for s in info.siblings or [] if s.blob_id}
        # and its size in bytes (a cached copy of another size is damaged before any hash says so)
        self.lfs_size: dict[str, int] = {
            s.rfilename: int(s.lfs.size) for s in info.siblings or [] if s.lfs and isinstance(s.lfs.size, int)
        }

    def resolve_url(self, name: str) -> str:
        return f"{self.endpoint}/{self.repo_id}/resolve/{self.commit}/{quote(name)}"

    def where(self, name: str) -> str:
        """`name` of this commit, as messages say it."""
        return f"{self.repo_id}/{name}@{self.commit[:12]}"

    def fetch(self, name: str, pos: int, out: memoryview, count: Callable[[int], None] | None = None) -> Remote:
        """Bytes [pos, pos + len(out)) of `name` into `out`, retried and resumed until all are in."""
        got = [0]

        def once() -> Remote:
            return self._get(name, pos + got[0], out[got[0] :], got, count)

        from huggingface_hub import errors as he

        try:
            return with_retries(once, f"{self.repo_id}/{name}", progress=lambda: got[0])
        except he.HfHubHTTPError as e:  # a 4xx no retry mends
            raise hub_error(self.repo_id, e, name) from e
        except SourceError as e:
            e.got = got[0]  # type: ignore[attr-defined]  # bytes that did arrive (a cache keeps them)
            raise

    def _get(self, name: str, pos: int, out: memoryview, got: list[int], count: Callable[[int], None] | None) -> Remote:
        n = len(out)
        with self.lock:
            url = self.urls.get(name)
        direct = url is not None
        headers = {"Range": f"bytes={pos}-{pos + n - 1}", "Accept-Encoding": "identity"}
        if not direct:
            url = self.resolve_url(name)
            headers.update(self.headers)  # the token goes to the Hub only; redirects off it drop it
        else:
            headers["user-agent"] = self.headers.get("user-agent", "reshard")
            pinned = self.pins.get(name, (None, 0))[0]
            if pinned:  # the bytes of the version served so far, or 412
                headers["If-Match"] = f'"{pinned}"'
        assert url is not None
        due = deadline(n)
        try:
            if direct and self.raw is not None:
                try:
                    with self.raw.get(url, headers, settings.HUB_TIMEOUT.get()) as a:
                        return self._receive(name, a, pos, out, got, count, due, direct)
                except rawhttp.Redirected:
                    pass  # huggingface_hub's client follows it
                except http.client.HTTPException as e:  # not HTTP, or cut short: the connection failed
                    raise Transient(f"{type(e).__name__}: {e}") from e
            with self.session.stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=settings.HUB_TIMEOUT.get()
            ) as r:
                return self._receive(name, r, pos, out, got, count, due, direct)
        except SourceError:
            raise
        except Exception as e:
            from huggingface_hub import errors as he

            if isinstance(e, he.HfHubHTTPError):
                status = getattr(e.response, "status_code", 0)
                if status in (401, 403, 404):
                    raise hub_error(self.repo_id, e, name) from e
            raise

    def _receive(
        self,
        name: str,
        r,
        pos: int,
        out: memoryview,
        got: list[int],
        count: Callable[[int], None] | None,
        due: float,
        direct: bool,
    ) -> Remote:
        """The answer `r` (httpx's, or rawhttp's Answer) checked, its body copied into `out`."""
        n = len(out)
        if r.status_code in (401, 403, 404, 410) and direct:  # a signed URL expired: resolve again
            with self.lock:
                self.urls.pop(name, None)
            raise Transient(f"HTTP {r.status_code} from the download URL")
        if r.status_code == 412:
            raise self._changed(name, "answered 412 Precondition Failed to If-Match")
        if r.status_code >= 400 and isinstance(r, rawhttp.Answer):
            if r.status_code >= 500 or r.status_code in (408, 429):
                raise Transient(f"HTTP {r.status_code} from the download URL")
            raise SourceError(
                f"{self.repo_id}/{name}: the download URL answered HTTP {r.status_code} to a range request",
                "run again; if it persists, report it with the status (the Hub's CDN refused a plain range)",
            )
        if r.status_code >= 400:
            from huggingface_hub.utils import hf_raise_for_status

            r.read()
            hf_raise_for_status(r)
        remote = self._check(name, r, pos, n)
        if r.history:
            with self.lock:
                self.urls[name] = str(r.url)
        fill = r.readinto1 if isinstance(r, rawhttp.Answer) else _copier(r)  # the former: socket -> `out`
        k = 0
        while k < n:
            m = fill(out[k:])
            if m == 0:
                break
            k += m
            got[0] += m
            if count is not None:
                count(m)
            if k < n and time.monotonic() > due:
                raise TooSlow(f"{k} of {n} bytes, slower than RESHARD_HUB_MIN_SPEED")
        if k < n:
            raise Transient(f"connection closed after {k} of {n} bytes")
        return remote

    def _check(self, name: str, r, pos: int, n: int) -> Remote:
        """The answer is the range asked for, of this commit's file: say its size and ETag."""
        first = r.history[0] if r.history else r
        commit = first.headers.get("X-Repo-Commit")
        if commit and commit != self.commit:
            raise SourceError(f"{self.repo_id}/{name}: the Hub served commit {commit}, not {self.commit}")
        etag = _etag(first.headers.get("X-Linked-Etag") or first.headers.get("ETag"))
        lfs = self.lfs.get(name)
        if first is not r and lfs and etag and etag != lfs:  # the Hub's redirect names another blob
            raise self._changed(name, f"linked ETag {etag[:12]}… for LFS sha256 {lfs[:12]}…")
        if r.status_code == 206:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", r.headers.get("Content-Range", "").strip())
            if not m or int(m.group(1)) != pos or int(m.group(2)) < pos + n - 1:
                raise Transient(f"{urlparse(str(r.url)).path}: wrong Content-Range {r.headers.get('Content-Range')!r}")
            size = int(m.group(3))
        elif r.status_code == 200 and pos == 0 and int(r.headers.get("Content-Length", -1)) >= n:
            size = int(r.headers.get("Content-Length", -1))  # ranges ignored: the whole file, its start is ours
        else:
            raise Transient(f"HTTP {r.status_code} to a range request")
        self._pin(name, _etag(r.headers.get("ETag")), size)
        return Remote(size, etag)

    def _pin(self, name: str, served: str | None, size: int) -> None:
        """Every answer for `name` is of one version: the ETag and total size of the first."""
        with self.lock:
            was = self.pins.setdefault(name, (served, size))
        if was[1] != size:
            raise self._changed(name, f"Content-Range total {size}, earlier {was[1]}")
        if was[0] != served:
            raise self._changed(name, f"ETag {served}, earlier {was[0]}")

    def _changed(self, name: str, what: str) -> SourceError:
        return SourceError(
            f"{self.repo_id}/{name}: the download served other bytes for a later range ({what})",
            "run again later; if it persists, the Hub's CDN serves a changed file: report it (nothing was published)",
        )


def _copier(r) -> Callable[[memoryview], int]:
    """httpx's body `r` as received, each chunk copied into the view it is given (re-chunking would
    copy once more); 0 at its end. A chunk longer than the view (more than was asked) is cut."""
    chunks = r.iter_raw(_RECV)

    def fill(view: memoryview) -> int:
        chunk = next(chunks, b"")
        m = min(len(chunk), len(view))
        if m < NUMPY_COPY:
            view[:m] = memoryview(chunk)[:m]
        else:  # numpy copies without the GIL, at twice a memoryview's speed here
            np.copyto(np.frombuffer(view, np.uint8, m), np.frombuffer(chunk, np.uint8, m))
        return m

    return fill


def _etag(value: str | None) -> str | None:
    return value.removeprefix("W/").strip('"') if value else None
