"""A bucket folder (`s3://bucket/prefix/`) as a `FolderView`: what `verify s3://...` checks and what an
output read back as SOURCE is read from.

- the listing is paginated and has no delimiter (as vLLM lists): every key under the prefix, nested
  ones too, is a name of the folder (relative to the prefix);
- a header is two ranged GETs at most (its first MiB, then the rest of a longer header);
- byte ranges are ranged GETs; a body cut mid-way is read again from where it stopped, up to
  RESHARD_S3_RETRIES times (botocore retries the requests themselves: throttling, 5xx, resets);
- a digest streams the object in RESHARD_S3_READ_BLOCK pieces (memory stays bounded), resuming
  the same way;
- `store_sha256` is the object's SHA256 as the store reports it (HEAD, ChecksumMode=ENABLED).

Every failure is one line of the view's error class (SourceError for a source, ...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from reshard import settings
from reshard.errors import ReshardError, SourceError
from reshard.folderview import FolderView, Header
from reshard.format import MAX_HEADER, parse_header
from reshard.hashing import new_hasher
from reshard.store.bucket import Bucket, ObjectInfo
from reshard.store.client import is_missing
from reshard.store.url import BucketURL

_FIRST = 1 << 20  # bytes of a header read in the first request
_BLOCK = 8 << 20  # bytes per read of a streamed object


class BucketView(FolderView):
    """The objects under one prefix, listed once (`refresh` lists again)."""

    def __init__(self, url: BucketURL, error: type[ReshardError] = SourceError, client: Any = None) -> None:
        self.bucket = Bucket(url, error, client)
        self.url = url
        self.display = str(url)
        self.error = error
        self._listing: dict[str, ObjectInfo] | None = None
        self._lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(settings.S3_CONCURRENCY.get())  # GETs in flight
        self._headers: dict[tuple[str, int | None], Header] = {}
        self.heads: dict[str, bytes] = {}  # each header's bytes as read (its length, then the JSON)

    # ---- the listing ------------------------------------------------------------------------------

    @property
    def listing(self) -> dict[str, ObjectInfo]:
        """Every object under the prefix by name (relative key), in key order."""
        with self._lock:
            if self._listing is None:
                self._listing = {self.url.name(o.key): o for o in self.bucket.list()}
            return self._listing

    def refresh(self) -> None:
        with self._lock:
            self._listing = None

    def where(self, name: str) -> str:
        return f"{self.url}{name}"

    def names(self) -> Iterable[str]:
        return list(self.listing)

    def exists(self, name: str) -> bool:
        return name in self.listing

    def size(self, name: str) -> int:
        info = self.listing.get(name)
        if info is None:
            raise FileNotFoundError(2, "no such object", self.where(name))
        return info.size

    def store_sha256(self, name: str) -> str | None:
        """The object's SHA256 as the store reports it ("<b64>-<parts>" for a multipart object),
        None when it reports none; FileNotFoundError when the object is gone."""
        r = self.bucket.head(self.url.key(name))
        if r is None:
            raise FileNotFoundError(2, "no such object", self.where(name))
        return r.get("ChecksumSHA256")

    # ---- reading ----------------------------------------------------------------------------------

    def header(self, name: str, *, size: int | None = None) -> Header:
        """Read once (cached: a rank file's header is read by the checks and again by the reader's setup)."""
        if (name, size) not in self._headers:
            self._headers[(name, size)] = self._header(name, size)
        return self._headers[(name, size)]

    def _header(self, name: str, size: int | None) -> Header:
        where = self.where(name)
        have = self.size(name)
        size = have if size is None else size
        head = self.read_range(name, 0, min(have, _FIRST))
        if len(head) < 8:
            raise SourceError(f"{where}: truncated safetensors file ({have} bytes)", "the object is damaged")
        n = int.from_bytes(head[:8], "little")
        if n > size - 8 or n > MAX_HEADER:
            raise SourceError(
                f"{where}: corrupt safetensors header (header length {n} but the object has {size} bytes)",
                "the object is damaged",
            )
        raw = head[8 : 8 + n]
        if len(raw) < n:
            raw += self.read_range(name, len(head), 8 + n - len(head))
        if len(raw) < n:
            raise SourceError(f"{where}: truncated safetensors header", "the object is damaged")
        self.heads[name] = bytes(head[:8]) + bytes(raw)
        return parse_header(raw, size, where, name.rsplit("/", 1)[-1])

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        parts: list[bytes] = []
        for chunk in self._body(name, start, length):
            parts.append(bytes(chunk))
        return b"".join(parts)

    def read_small(self, name: str, limit: int) -> bytes:
        data = self.bucket.get(self.url.key(name), limit=limit)
        if data is None:
            raise FileNotFoundError(2, "no such object", self.where(name))
        return data

    def digest(
        self, name: str, algorithm: str, *, size: int, advance: Callable[[int], None] | None = None
    ) -> str | None:
        if self.size(name) != size:
            return ""
        h = new_hasher(algorithm)
        got = 0
        for chunk in self._body(name, 0, size):
            h.update(chunk)
            got += len(chunk)
            if advance is not None:
                advance(len(chunk))
        return h.hexdigest() if got == size else ""

    def _body(self, name: str, start: int, length: int) -> Iterator[bytes]:
        """Bytes [start, start + length) of `name` in pieces of at most _BLOCK; a body that breaks
        off is asked for again from where it stopped (RESHARD_S3_RETRIES times); fewer bytes only
        where the object ends."""
        import botocore.exceptions as bx

        key, pos, end = self.url.key(name), start, start + length
        retries, failures = settings.S3_RETRIES.get(), 0
        while pos < end:
            with self.slots:
                try:
                    r = self.bucket.client.get_object(Bucket=self.url.bucket, Key=key, Range=f"bytes={pos}-{end - 1}")
                except Exception as e:
                    if is_missing(e):
                        raise FileNotFoundError(2, "no such object", self.where(name)) from None
                    if _invalid_range(e):
                        return  # at or past the object's end
                    raise self.bucket.fail(e, f"reading {name}") from e
                total = _total(r, pos)
                body = r["Body"]
                try:
                    while pos < end and (chunk := body.read(min(_BLOCK, end - pos))):
                        pos += len(chunk)
                        yield chunk
                except (bx.ReadTimeoutError, bx.ResponseStreamingError, bx.IncompleteReadError, OSError) as e:
                    cut: BaseException | None = e
                else:
                    cut = None
                finally:
                    body.close()
            if pos >= min(end, total):
                return  # all asked for, or the object ends here
            failures += 1  # the body broke off: ask again from here
            if failures > retries:
                why = cut or bx.ConnectionClosedError(endpoint_url=self.bucket.client.meta.endpoint_url)
                raise self.bucket.fail(bx.ConnectionClosedError(endpoint_url=str(why)), f"reading {name}")


def _total(r: dict, pos: int) -> int:
    """The object's size from a ranged GET's Content-Range ("bytes 0-99/1234")."""
    rng = str(r.get("ContentRange") or "")
    tail = rng.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else pos + int(r.get("ContentLength", 0))


def _invalid_range(e: BaseException) -> bool:
    from reshard.store.client import error_code, status

    return error_code(e) == "InvalidRange" or status(e) == 416


def unvouched(
    names: list[str], recorded: dict[str, str] | None, reported: dict[str, object] | None, noun: str = "objects"
) -> tuple[list[str], str]:
    """Which of the objects `names` the store's checksums cannot vouch for, and why: `reshard verify` and a
    bucket SOURCE decide it alike. Every one when the manifest recorded no store checksums, or when the
    store reports none for any object (`reported`: each object's SHA256 as the store reports it, None for
    none, an error counting as reported; copied to a store that keeps none, a proxy that strips them);
    else those the manifest recorded none for. The save's store reported one for every object (reshard
    refuses one that does not), so it is decided from the objects, never from the manifest's own."""
    if not recorded:
        return list(names), "the manifest records no store checksums (not saved to a bucket by this reshard)"
    if reported and all(v is None for v in reported.values()):
        return list(names), (
            "the object store reports no SHA256 checksum for any object (copied to a store that keeps none, "
            "or a proxy that strips them?)"
        )
    missing = [n for n in names if recorded.get(n) is None]
    some = missing[0] if len(missing) == 1 else f"{len(missing)} {noun}"
    return missing, f"the manifest records no store checksum for {some}"
