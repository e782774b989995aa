"""Streaming multipart uploads, each part checked by the store, kept open until the run publishes.

An output file goes to the bucket as a multipart upload while it is computed: its bytes fill a part
buffer (RESHARD_S3_PART_SIZE, grown for files over 10000 parts), and each full part is uploaded by a
shared pool (RESHARD_S3_CONCURRENCY parts at once) with its SHA256 in `x-amz-checksum-sha256`,
which the store checks (BadDigest otherwise; retried from memory). Nothing is staged on local disk.

An upload is not an object until it is completed, so the run's uploads stay open, invisible to
readers, until every file is uploaded: `reshard.store.publish` then completes them all, the
manifest last, and compares each object's checksum as the store reports it (the composite SHA256 of
the parts) with the one computed here. A failure or an interrupt aborts them (`Uploads.abort_all`).

Memory: each open file holds one part buffer, and at most RESHARD_S3_CONCURRENCY parts are in flight.
Part buffers are reused (`Uploads.buffer` / `_recycle`): a fresh zeroed 16 MiB bytearray per part
cost its page faults and memset on the thread feeding the rank files (docs/benchmarks.md, section 7).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard import settings
from reshard.errors import ReshardError
from reshard.hashing import new_hasher
from reshard.io.writer import NUMPY_COPY, Sink, Written
from reshard.store.bucket import Bucket
from reshard.store.client import error_code, store_error

if TYPE_CHECKING:
    from reshard.plan import OutTensor

MAX_PARTS = 10000  # S3's limit per upload
_MIB = 1 << 20
_BAD_DIGEST_RETRIES = 2


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


@dataclass
class OpenUpload:
    """A multipart upload whose parts are all in, not yet completed."""

    key: str
    upload_id: str
    size: int = 0
    parts: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # number -> (ETag, sha256)
    created: Future | None = field(default=None, repr=False, compare=False)  # started in the pool: its parts wait

    def part_list(self) -> list[dict[str, Any]]:
        return [
            {"PartNumber": n, "ETag": etag, "ChecksumSHA256": _b64(digest)}
            for n, (etag, digest) in sorted(self.parts.items())
        ]

    def to_json(self) -> dict[str, Any]:
        """What completing it needs (a commit journal, or a torchrun process handing it over)."""
        parts = [[n, etag, _b64(digest)] for n, (etag, digest) in sorted(self.parts.items())]
        return {"key": self.key, "upload_id": self.upload_id, "size": self.size, "parts": parts}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> OpenUpload:
        up = OpenUpload(str(obj["key"]), str(obj["upload_id"]), int(obj["size"]))
        for n, etag, digest in obj["parts"]:
            up.parts[int(n)] = (str(etag), base64.b64decode(digest))
        return up

    def checksum(self) -> str:
        """The object's SHA256 as S3 reports a multipart object's: the SHA256 of the parts' SHA256s, "-" parts."""
        joined = b"".join(d for _, (_, d) in sorted(self.parts.items()))
        return f"{_b64(hashlib.sha256(joined).digest())}-{len(self.parts)}"


class Uploads:
    """The run's multipart uploads into one bucket folder: a pool of part uploads, and every upload
    still open (to complete at publish, or to abort)."""

    def __init__(self, bucket: Bucket) -> None:
        self.client = bucket.client
        self.url = bucket.url
        self.error = bucket.error
        self.concurrency = settings.S3_CONCURRENCY.get()
        self.part_size = settings.S3_PART_SIZE.get()
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reshard-s3")
        self.slots = threading.Semaphore(self.concurrency)
        self.lock = threading.Lock()
        self.open: dict[str, OpenUpload] = {}
        self.unchecked: set[str] = set()  # keys whose parts the store did not echo a checksum for
        self.begun: list[OpenUpload] = []  # uploads `begin` started in the pool
        self.free: list[bytearray] = []  # part buffers of part_size whose upload is done, for reuse

    def buffer(self, size: int) -> bytearray:
        """A part buffer of `size` bytes: a reused one when `size` is the part size and one is free."""
        if size == self.part_size:
            with self.lock:
                if self.free:
                    return self.free.pop()
        return bytearray(size)

    def _recycle(self, data: object) -> None:
        """Keep a sent part's buffer for the next part. Every one is kept: at most the open files'
        plus RESHARD_S3_CONCURRENCY in flight exist at once, so the free list never holds more than
        the run already had in use; keeping only some had each open file fault in a fresh, zeroed
        16 MiB per part (a fifth of the save's CPU over an upload's, docs/benchmarks.md section 7)."""
        if isinstance(data, bytearray) and len(data) == self.part_size:
            with self.lock:
                self.free.append(data)

    def fail(self, e: BaseException, doing: str) -> ReshardError:
        return store_error(e, str(self.url), doing, self.error)

    def _create(self, up: OpenUpload) -> OpenUpload:
        try:
            r = self.client.create_multipart_upload(Bucket=self.url.bucket, Key=up.key, ChecksumAlgorithm="SHA256")
        except Exception as e:
            raise self.fail(e, f"starting the upload of {up.key}") from e
        up.upload_id = r["UploadId"]
        with self.lock:
            self.open[up.key] = up
        return up

    def begin(self, key: str) -> OpenUpload:
        """Start the upload of `key` in the pool, not on the caller's thread: the executor opens its
        files one after another on the thread that feeds them all, and a request per file there
        (8 at TP 8) held back the first parts by a quarter of a second on a local store. Its parts
        wait for it (it is queued before them, so it runs first)."""
        up = OpenUpload(key, "")
        with self.lock:
            self.begun.append(up)
        up.created = self.pool.submit(self._create, up)
        return up

    def adopt(self, up: OpenUpload) -> None:
        """An upload another process left open (torchrun), to complete with this run's."""
        with self.lock:
            self.open[up.key] = up

    def part_size_for(self, size: int) -> int:
        """Parts of at least RESHARD_S3_PART_SIZE, and few enough for a `size`-byte object."""
        return max(self.part_size, math.ceil(size / MAX_PARTS / _MIB) * _MIB)

    def submit(self, up: OpenUpload, number: int, data: bytes | bytearray | memoryview) -> Future:
        """Upload part `number` of `up` (waits while RESHARD_S3_CONCURRENCY parts are in flight)."""
        self.slots.acquire()
        try:
            return self.pool.submit(self._put_part, up, number, data)
        except BaseException:
            self.slots.release()
            raise

    def _put_part(self, up: OpenUpload, number: int, data: bytes | bytearray | memoryview) -> None:
        try:
            if up.created is not None:
                up.created.result()  # raises the failed start's error
            body = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # botocore takes no memoryview
            digest = hashlib.sha256(body).digest()
            for attempt in range(_BAD_DIGEST_RETRIES + 1):
                try:
                    r = self.client.upload_part(
                        Bucket=self.url.bucket,
                        Key=up.key,
                        UploadId=up.upload_id,
                        PartNumber=number,
                        Body=body,
                        ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=_b64(digest),
                    )
                    break
                except Exception as e:
                    if error_code(e) == "BadDigest" and attempt < _BAD_DIGEST_RETRIES:
                        continue
                    raise self.fail(e, f"uploading part {number} of {self.url.name(up.key)}") from e
            echoed = r.get("ChecksumSHA256")
            if echoed is not None and echoed != _b64(digest):
                raise self.error(
                    f"the object store recorded another checksum for part {number} of {self.url.name(up.key)}",
                    "a proxy or the store altered the upload; rerun",
                )
            with self.lock:
                if echoed is None:
                    self.unchecked.add(up.key)
                up.parts[number] = (r["ETag"], digest)
            self._recycle(data)  # uploaded: botocore holds no reference to the body any more
        finally:
            self.slots.release()

    def put_objects(self, items: list[tuple[str, bytes]]) -> list[OpenUpload]:
        """Small objects (side files, the manifest), each a one-part upload left open like the rest,
        all at once: one after the other they were two round trips each at the end of every save."""
        ups = [self.begin(key) for key, _ in items]
        _all_done([self.submit(up, 1, data) for up, (_, data) in zip(ups, items, strict=True)])
        for up, (_, data) in zip(ups, items, strict=True):
            up.size = len(data)
        return ups

    def complete(self, up: OpenUpload, *, create_only: bool) -> None:
        """Make `up` an object; `create_only`: only if none exists under its key (If-None-Match: *).
        The checksum the store reports for the object must be the one computed here."""
        kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        try:
            r = self.client.complete_multipart_upload(
                Bucket=self.url.bucket,
                Key=up.key,
                UploadId=up.upload_id,
                MultipartUpload={"Parts": up.part_list()},
                **kwargs,
            )
        except Exception as e:
            raise self.fail(e, f"completing {self.url.name(up.key)}") from e
        with self.lock:
            self.open.pop(up.key, None)
        reported = r.get("ChecksumSHA256")
        if reported is not None and reported != up.checksum():
            raise self.error(
                f"the object store reports checksum {reported} for {self.url.name(up.key)}, "
                f"not the {up.checksum()} of the parts reshard uploaded",
                "the store assembled other bytes; rerun, and check the store",
            )

    def complete_all(self, ups: list[OpenUpload], create_only: Callable[[OpenUpload], bool]) -> None:
        """Complete `ups`, RESHARD_S3_CONCURRENCY at a time: each is a round trip (tens of ms on a
        remote store), and a large model's output has hundreds of files."""
        _all_done([self.pool.submit(self.complete, up, create_only=create_only(up)) for up in ups])

    def abort_all(self) -> None:
        """Abort every upload still open (best effort: a failure here is not the error to report);
        uploads still starting in the pool are waited for first, or cancelled if not yet started."""
        with self.lock:
            begun, self.begun = self.begun, []
        for up in begun:
            if up.created is not None and not up.created.cancel():
                with contextlib.suppress(Exception):
                    up.created.result()
        with self.lock:
            ups, self.open = list(self.open.values()), {}
        for up in ups:
            # best effort: the next run lists and aborts what is left (reshard.store.publish)
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=up.key, UploadId=up.upload_id)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _all_done(futures: list[Future]) -> None:
    """Wait for every one, then raise the first failure: nothing is left running behind an error."""
    wait(futures)
    for f in futures:
        f.result()


class ObjectWriter(Sink):
    """An output file streamed into a multipart upload (a `Sink`): hashed for the manifest as it
    comes, cut into parts, each uploaded with its SHA256 while the next fills."""

    def __init__(self, uploads: Uploads, name: str, header: bytes, checksum: str, size: int) -> None:
        self.uploads = uploads
        self.name = name
        self.up = uploads.begin(uploads.url.key(name))
        self.part_size = uploads.part_size_for(size)
        self.hasher = new_hasher(checksum)
        # the part buffer is taken on the first write, on the writer's thread: the executor opens
        # every file's sink from its main thread, which feeds all the writers
        self.buf = bytearray()
        self.header: bytes | None = header
        self.fill = 0
        self.number = 0
        self.size = 0
        self.pending: list[Future] = []

    def begin(self, tensor: OutTensor) -> None:
        pass

    def write(self, data: memoryview | bytes) -> None:
        if self.header is not None:
            header, self.header = self.header, None
            self.buf = self.uploads.buffer(self.part_size)
            self.write(header)
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        self.hasher.update(view)
        n, pos = view.nbytes, 0
        self.size += n
        while pos < n:
            k = min(n - pos, self.part_size - self.fill)
            if k < NUMPY_COPY:
                self.buf[self.fill : self.fill + k] = view[pos : pos + k]
            else:  # numpy copies without the GIL (a bytearray slice assignment holds it, and copied at half the speed here)
                dst = np.frombuffer(self.buf, np.uint8, k, self.fill)
                np.copyto(dst, np.frombuffer(view[pos : pos + k], np.uint8))
                del dst  # no view of the buffer outlives its upload
            self.fill += k
            pos += k
            if self.fill == self.part_size:
                self._send()

    def write_array(self, arr: np.ndarray) -> None:
        """Write a strided array's bytes (uint8, or wider words) in C order, gathered straight into the part buffer (the
        default stages it first: a second copy of every column-split byte)."""
        if not arr.nbytes:
            return
        if self.header is not None:
            self.write(b"")
        rows, row = arr.shape[0], arr[0].nbytes
        r = 0
        while r < rows:
            k = min(rows - r, (self.part_size - self.fill) // row)
            if k == 0:  # the next row straddles the end of the part (or is larger than it)
                self.write(np.ascontiguousarray(arr[r]).reshape(-1))
                r += 1
                continue
            start, n = self.fill, k * row
            dst = np.frombuffer(self.buf, np.uint8, n, start).view(arr.dtype).reshape((k, *arr.shape[1:]))
            np.copyto(dst, arr[r : r + k])
            del dst  # no view of the buffer outlives its upload
            self.hasher.update(memoryview(self.buf)[start : start + n])
            self.fill += n
            self.size += n
            r += k
            if self.fill == self.part_size:
                self._send()

    def _send(self) -> None:
        """Upload the part buffer (a new one takes its place); raise the first failed part's error."""
        self._check()
        self.number += 1
        data = self.buf if self.fill == len(self.buf) else bytes(memoryview(self.buf)[: self.fill])
        self.pending.append(self.uploads.submit(self.up, self.number, data))
        self.buf = self.uploads.buffer(self.part_size) if self.fill == len(self.buf) else self.buf
        self.fill = 0

    def _check(self) -> None:
        done = [f for f in self.pending if f.done()]
        for f in done:
            f.result()
        self.pending = [f for f in self.pending if not f.done()]

    def close(self, sync: bool) -> Written:
        if self.header is not None:
            self.write(b"")
        if self.fill or self.number == 0:
            self._send()
        for f in self.pending:
            f.result()
        self.pending = []
        if self.up.created is not None:
            self.up.created.result()  # done: its parts waited for it
        self.up.size = self.size
        self.uploads._recycle(self.buf)
        self.buf = bytearray()
        return Written(self.name, self.size, self.hasher.hexdigest())

    def abort(self) -> None:
        for f in self.pending:
            f.cancel()
        self.buf = bytearray()
