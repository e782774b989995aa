"""A reshard output in a bucket (`s3://bucket/prefix/`) read as the checkpoint it was made from: `save
s3://OUT s3://NEW` or `save s3://OUT LOCAL` (re-shard from the store) and `merge s3://OUT HF_DIR`.

Nothing of the rank files is copied to local disk: tensors are read with ranged GETs
(`reshard.store.view.BucketView`: RESHARD_S3_CONCURRENCY at once, a cut body resumed, requests
retried by botocore). The side files (config, tokenizer; small) are fetched into a temporary folder,
each checked against the manifest's digest.

What is checked, reading each rank file once where the store vouches for it:
- before anything is read: every file the manifest lists is there with its size, and (where the
  manifest recorded them) each object's SHA256 as the store reports it is the one reshard uploaded:
  an object replaced since fails here (exit 7, as a local output that fails its checks);
- while reading: the bytes of each rank file are hashed as they arrive when they arrive in order (a
  few out-of-order reads are held back, bounded); a file read whole that way is checked against the
  manifest's digest when the save has read everything (`finish`, before anything is published): a
  mismatch is exit 7. A file not read whole in order (a re-shard reads by tensor, not by file) and
  vouched for by the store's checksum is said to be unhashed, in a note;
- a file the store cannot vouch for (it reports no SHA256 for the objects: copied to a store that
  keeps none, a proxy that strips them; or the manifest recorded none for it) and not read whole in
  order is hashed from the bytes the save read (every read of it is fed to its hasher) and a read of
  the bytes it did not, at `finish`, said in a note first (a mismatch: exit 7); under torchrun each
  process hashes its share of them (reshard.sources.bucket_custody). An output saved with --checksum none has no
  digests to hash against: its bytes are then read unchecked, said in a note.

A prefix with no manifest, a missing bucket and a store that cannot be read are exit 4 (not found,
or unreadable); an output there that is malformed, incomplete or altered is exit 7.
"""

from __future__ import annotations

import atexit
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from reshard import settings
from reshard.checkpoint import Checkpoint, Reader, Source
from reshard.errors import CorruptError, SourceError, UnsupportedError
from reshard.folderview import view_manifest
from reshard.format import ITEMSIZE
from reshard.hashing import NONE, hash_bytes, new_hasher
from reshard.manifest import Manifest
from reshard.names import MANIFEST
from reshard.scratch import make_scratch_dir
from reshard.sources.bucket_custody import Custody
from reshard.sources.output import check_complete, read_output
from reshard.sources.output_reader import OutputReader, Regions
from reshard.store.url import BucketURL
from reshard.store.view import BucketView
from reshard.store.view import unvouched as vouched_for

MAX_HELD = 64 << 20  # bytes of out-of-order reads held back per reader for the in-order hash
MAX_FILL = 16 << 20  # bytes of a span no tensor read needs (the header, a dropped replica) fetched to hash on
MAX_SIDE = 256 << 20  # bytes of one side file
_HINT = "run `reshard verify` on it, or reshard the original checkpoint"


class BucketOutputSource(Source):
    def __init__(self, url: BucketURL, *, checksums: bool = True) -> None:
        self.url = url
        self.view = BucketView(url, SourceError)
        self.manifest = manifest = _manifest(self.view)
        check_complete(str(url), manifest)
        self.checksums = checksums and manifest.checksum != NONE
        # the rank files the store's checksums cannot vouch for, and why
        self.unvouched, self.why = _check_objects(self.view, manifest, store=checksums)
        if self.unvouched and checksums and not self.checksums:
            _note(
                f"{self.why}, and the manifest records no digests (saved with --checksum none): the bytes of "
                f"{_some(self.unvouched)} are read unchecked (their sizes were checked)"
            )
        self.root = make_scratch_dir("source-side")  # a killed run's: removed by the next (reshard.scratch)
        atexit.register(shutil.rmtree, self.root, True)
        _fetch_side_files(self.view, manifest, self.root)
        self._checkpoint, self.regions = read_output(self.view, manifest, self.root, {"url": str(url)})
        self.fill = _unread(self.view, [f.name for f in manifest.files], self._checkpoint, self.regions)
        self.readers: list[BucketOutputReader] = []
        self.share = (0, 1)  # (this process, processes) that read it: under torchrun, each hashes its share
        self.custody: Custody | None = None  # the bytes read of the files the store cannot vouch for

    def split(self, rank: int, world: int) -> None:
        self.share = (rank, world)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def open_reader(self) -> Reader:
        if self.custody is None and self.checksums and self.unvouched:
            rank, world = self.share
            files = self.manifest.files
            mine = {f.name for i, f in enumerate(files) if i % world == rank}
            unvouched = [f for f in files if f.name in self.unvouched]
            self.custody = Custody(unvouched, mine, self.manifest.checksum, self.view.where, _HINT)
            for f in unvouched:  # the header each layout was read from: used, so vouched for too
                self.custody.feed(f.name, 0, self.view.heads[f.name])
        reader = BucketOutputReader(self, self.regions)
        self.readers.append(reader)
        return reader

    def finish(self) -> None:
        """Every rank file read whole in order is checked against its digest (exit 7 otherwise); those
        the store cannot vouch for are checked from the bytes the save used, reading what it did not
        (this process's share of them under torchrun: reshard.sources.bucket_custody); the rest
        (vouched for by the store's checksums) are told as unhashed."""
        if not self.checksums:
            return
        checked: set[str] = set()
        for reader in self.readers:
            for name, stream in reader.streams.items():
                if stream.whole:
                    if stream.digest() != stream.want:
                        raise self._mismatch(name)
                    checked.add(name)
        from reshard.console import human_bytes

        files = self.manifest.files
        custody = self.custody
        if custody is not None and custody.hashers:
            mine = [f for f in files if f.name in custody.hashers]
            _note(
                f"{self.why}: hashing {_some([f.name for f in mine])} ({human_bytes(sum(f.size for f in mine))}) "
                f"against the manifest's {self.manifest.checksum} digests from the bytes read, reading the "
                f"{human_bytes(custody.unread())} not read"
            )
        if custody is not None:
            self._check(custody)
        unhashed = [f.name for f in files if f.name not in checked and f.name not in self.unvouched]
        if unhashed:
            _note(
                f"{len(unhashed)} of {len(files)} rank files were read by tensor, not whole in order: their bytes "
                f"were not hashed (sizes and store checksums were checked; `reshard verify {self.url} --deep` "
                "hashes them)"
            )

    def _check(self, custody: Custody) -> None:
        """Run the custody's checks (several files at once, largest first); the first that fails: exit 7."""
        get = self.readers[0]._get if self.readers else None
        assert get is not None, "checked after reading"
        jobs = sorted(custody.jobs(get, self._mismatch), key=lambda job: -job[0])
        if not jobs:
            return
        workers = max(1, min(len(jobs), settings.S3_CONCURRENCY.get()))
        with ThreadPoolExecutor(workers, thread_name_prefix="reshard-hash") as pool:
            futures = [pool.submit(job) for _, job in jobs]
            try:
                for fut in as_completed(futures):
                    fut.result()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # the files not started yet: not read at all
                raise

    def _mismatch(self, name: str) -> CorruptError:
        return CorruptError(
            f"{self.view.where(name)} fails its {self.manifest.checksum} checksum as read from the bucket: the object "
            "changed after it was written",
            _HINT,
        )


class _Stream:
    """One rank file's bytes hashed in order as they are read; reads ahead of the hash are held
    back (up to the reader's budget), reads behind it ignored."""

    def __init__(self, size: int, algorithm: str, want: str | None, fill: list[tuple[int, int]]) -> None:
        self.size = size
        self.fill = fill  # (offset, length) no read will cover, in file order: fetched when the hash gets there
        self.want = want
        self.hasher = new_hasher(algorithm)
        self.pos = 0
        self.held: dict[int, bytes] = {}
        self.broken = False

    @property
    def whole(self) -> bool:
        return not self.broken and self.pos == self.size

    def digest(self) -> str | None:
        return self.hasher.hexdigest()

    def feed(self, offset: int, data: bytes) -> int:
        """Take `data` read at `offset`; returns the change in bytes held back."""
        if self.broken or offset + len(data) <= self.pos:
            return 0
        if offset > self.pos:
            if offset in self.held:
                return 0
            self.held[offset] = data
            return len(data)
        freed = 0
        self.hasher.update(memoryview(data)[self.pos - offset :])
        self.pos = offset + len(data)
        while self.held:
            nxt = min(self.held)
            if nxt > self.pos:
                break
            chunk = self.held.pop(nxt)
            freed += len(chunk)
            if nxt + len(chunk) > self.pos:
                self.hasher.update(memoryview(chunk)[self.pos - nxt :])
                self.pos = nxt + len(chunk)
        return -freed

    def next_fill(self) -> tuple[int, int] | None:
        """The span to fetch now for the hash to go on, if it has reached one."""
        while self.fill and self.fill[0][0] + self.fill[0][1] <= self.pos:
            self.fill.pop(0)
        if self.broken or not self.fill or self.fill[0][0] != self.pos:
            return None
        return self.fill.pop(0)

    def drop(self) -> int:
        freed = sum(len(c) for c in self.held.values())
        self.held.clear()
        self.broken = True
        return freed


class BucketOutputReader(OutputReader):
    """`OutputReader` over ranged GETs, hashing each file in order where the reads allow."""

    def __init__(self, source: BucketOutputSource, regions: Regions) -> None:
        if regions.strided():
            raise UnsupportedError(
                f"{source.view.display} holds K-first packed weights side by side (GPTQ / AWQ merged layers); "
                "reading them back from a bucket is not supported",
                "download the output, or re-shard from the original Hugging Face checkpoint",
            )
        super().__init__(source.root, regions)
        self.view = source.view
        self.lock = threading.Lock()
        self.held = 0
        self.streams: dict[str, _Stream] = {}
        self.custody = source.custody  # the files the store cannot vouch for: every byte read is fed to it
        if source.checksums:
            m = source.manifest
            self.streams = {
                f.name: _Stream(f.size, m.checksum, f.digest, source.fill[f.name])
                for f in m.files
                if f.name not in source.unvouched
            }

    def _pread(self, file: str, offset: int, nbytes: int) -> bytes:
        stream = self.streams.get(file)
        if stream is not None:
            self._fill(file, stream)  # the header, first
        data = self._get(file, offset, nbytes)
        if self.custody is not None:
            self.custody.feed(file, offset, data)
        if stream is not None:
            self._feed(stream, offset, data)
            self._fill(file, stream)
        return data

    def _fill(self, file: str, stream: _Stream) -> None:
        """Fetch the spans no read covers where the hash has got to them (small: else unchecked)."""
        while True:
            with self.lock:
                span = stream.next_fill()
            if span is None:
                return
            if span[1] > MAX_FILL:
                with self.lock:
                    self.held -= stream.drop()
                return
            self._feed(stream, span[0], self._get(file, *span))

    def _get(self, file: str, offset: int, nbytes: int) -> bytes:
        try:
            data = self.view.read_range(file, offset, nbytes)
        except FileNotFoundError:
            raise CorruptError(f"{self.view.where(file)} is gone (deleted while it was read)", _HINT) from None
        if len(data) != nbytes:
            raise CorruptError(f"{self.view.where(file)}: truncated (changed while it was read)", _HINT)
        return data

    def _feed(self, stream: _Stream, offset: int, data: bytes) -> None:
        with self.lock:
            self.held += stream.feed(offset, data)
            if self.held > MAX_HELD:  # too far out of order: give up the largest holder's hash
                worst = max(self.streams.values(), key=lambda s: sum(len(c) for c in s.held.values()))
                self.held -= worst.drop()


def _unread(view: BucketView, names: list[str], ckpt: Checkpoint, regions: Regions) -> dict[str, list[tuple[int, int]]]:
    """The spans of each of the files `names` no read covers: its header, alignment gaps, rows of
    vocabulary padding, tensors read once from another file (replicas) or not at all."""
    spans: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for file, begin, end in regions.spans(lambda tensor: ITEMSIZE[ckpt.tensors[tensor].dtype]):
        spans[file].append((begin, end))
    fill = {}
    for name in names:
        end = view.size(name)
        out, pos = [], 0
        for a, b in [*sorted(spans[name]), (end, end)]:
            if a > pos:
                out.append((pos, a - pos))
            pos = max(pos, b)
        fill[name] = out
    return fill


def _manifest(view: BucketView) -> Manifest:
    """The prefix's manifest: none there is exit 4 (no output at that address), a malformed one 7."""
    try:
        return view_manifest(view)
    except CorruptError as e:
        if not view.exists(MANIFEST):
            raise SourceError(e.message, "check the address: a bucket SOURCE is an output of `reshard save`") from None
        raise CorruptError(e.message, e.hint or _HINT) from None


def _check_objects(view: BucketView, manifest: Manifest, *, store: bool) -> tuple[set[str], str]:
    """Every listed file there with its size; with `store`, each object's store SHA256 as recorded.
    Returns the rank files the store's checksums cannot vouch for (as `reshard verify` decides it:
    none recorded in the manifest, none reported by the store for any object), and why."""
    problems = []
    for f in manifest.files:
        info = view.listing.get(f.name)
        if info is None:
            problems.append(f"{f.name} is missing")
        elif info.size != f.size:
            problems.append(f"{f.name} has {info.size} bytes, the manifest says {f.size}")
    names = [f.name for f in manifest.files]
    sums = manifest.store_sha256 if store else None
    unvouched, why = set(), ""
    if store and not sums:
        missing, why = vouched_for(names, sums, None)
        unvouched = set(missing)
    if not problems and sums:
        with ThreadPoolExecutor(settings.S3_CONCURRENCY.get(), thread_name_prefix="reshard-head") as pool:
            have = dict(zip(names, pool.map(view.store_sha256, names), strict=True))
        missing, why = vouched_for(names, sums, have, "rank files")
        unvouched = set(missing)
        if any(h is not None for h in have.values()):  # the store reports SHA256s: each as recorded
            problems += [f"{n} was replaced after it was written" for n in names if sums.get(n) not in (None, have[n])]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptError(f"{view.url} cannot be used as SOURCE: {problems[0]}{more}", _HINT)
    return unvouched, why


def _some(names: list[str] | set[str]) -> str:
    """One rank file by its name, or how many."""
    return next(iter(names)) if len(names) == 1 else f"{len(names)} rank files"


def _note(line: str) -> None:
    from reshard.console import note

    note(line)


def _fetch_side_files(view: BucketView, manifest: Manifest, root: Path) -> None:
    """The copied files (config, tokenizer, ...) into `root`, each checked against its digest."""
    for side in manifest.copied_files:
        try:
            data = view.read_small(side.name, MAX_SIDE)
        except FileNotFoundError:
            raise CorruptError(f"{view.where(side.name)} is missing", _HINT) from None
        if len(data) != side.size or (side.digest is not None and hash_bytes(data, manifest.checksum) != side.digest):
            raise CorruptError(f"{view.where(side.name)} fails its checksum: it changed after it was written", _HINT)
        dst = root / side.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
