"""A Hub repo read over HTTP in the order the save consumes it: writing starts with the first bytes.

Planning needs config.json and the safetensors headers only: config, tokenizer and the other small
files come through huggingface_hub's cache, and each weight file's header through two range requests
(its 8-byte length, then the JSON), before any weight byte. `HubReader` then fetches exactly the byte
ranges the executor's schedule asks for, on RESHARD_HUB_CONNECTIONS connections at once, straight into the
executor's bounded read-ahead buffers (`reshard.io.memory`): download and re-sharding overlap. Bytes
that several reads use (Llama-4's q/k rows, read as even and odd rows per head) are fetched once
(reshard.sources.hubshare), small neighbouring tensors together (reshard.sources.hubgroups).

Two modes:
- stream (`save --stream`): nothing of the source is stored; disk = the output.
- cached (default): every range fetched is also written at its offset into the cache's blob
  (`blobs/<etag>.reshard-partial`, the ranges it holds listed in `<etag>.reshard-ranges`:
  reshard.sources.hubblob); a run that stopped resumes from it, reading what it holds from disk.
  When the save has succeeded, `finish` fetches the bytes no tensor needed (headers, unused
  tensors), renames the blob into place and links it from `snapshots/<commit>/`, as
  huggingface_hub lays out its cache (so HF_HUB_OFFLINE finds it later). The source is stored once.

Each file is hashed (sha256) from the ranges read, as they arrive (`PrefixHasher`, which vouches that
the bytes hashed are the bytes used); `finish` hashes the rest (from the completed blob, or fetched
with --stream) and checks the LFS sha256 before the save publishes (reshard.sources.integrity); a file
stored in git, not LFS, is read once more, whole, for its git blob sha1. A blob holds exactly the bytes
hashed: the header fetched for the plan is written over what an earlier run left in a partial blob
(`Blob.put_head`), and a range fetched and stored twice is checked in both copies (reshard.sources.hubblob).
"""

from __future__ import annotations

import contextlib
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reshard import settings
from reshard.bulk import paused_gc
from reshard.checkpoint import Checkpoint, Reader, Source
from reshard.console import human_bytes, note
from reshard.errors import SourceError
from reshard.format import MAX_HEADER, TensorInfo, parse_header
from reshard.io.reader import AlignedReader, ByteRange, Prepared
from reshard.manifest.schema import SourceFileRecord
from reshard.sources import prefixhash
from reshard.sources.hubblob import Blob, published_by_another, read_from
from reshard.sources.hubgroups import Groups
from reshard.sources.hubhttp import HubRepo, Meter
from reshard.sources.hubshare import Shares
from reshard.sources.hubsmall import expected
from reshard.sources.integrity import GIT, HUB, UNCHECKED, mismatch, whole_digests
from reshard.sources.local import read_config
from reshard.sources.prefixhash import PrefixHasher, taken_again
from reshard.sources.spill import Spill, usable

_FILL = 64 * 1024 * 1024  # bytes per request when completing a cached blob


class HubSource(Source):
    """A repo's metadata from the Hub (side files cached, headers by range), its bytes by `HubReader`."""

    def __init__(self, repo: HubRepo, root: Path, files: list[str], *, stream: bool) -> None:
        self.repo = repo
        self.stream = stream
        self.meter = repo.meter
        self.etags: dict[str, str | None] = {}
        self.blobs: dict[str, Blob] = {}
        self.heads: dict[str, bytes] = {}  # each file's first bytes (length and header), kept for the cache
        self.spill: Spill | None = None  # where bytes read ahead of a file's hash wait, for files stored nothing of
        self.others: dict[str, Blob] = {}  # the blobs another run in this cache fills
        tensors: dict[str, TensorInfo] = {}
        sizes: dict[str, int] = {}
        with ThreadPoolExecutor(min(settings.HUB_CONNECTIONS.get(), len(files))) as pool:
            for name, (found, size, etag) in zip(files, pool.map(self._header, files), strict=True):
                sizes[name] = size
                self.etags[name] = etag
                for key, info in found.items():
                    if key in tensors:
                        raise SourceError(
                            f"{repo.repo_id}: tensor {key!r} appears in {tensors[key].file} and {name}",
                            "the repo holds two copies of it: ask its owners, or pass a --revision without them",
                        )
                    tensors[key] = info
        ref = {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit}
        self._checkpoint = Checkpoint(root, read_config(root), tensors, files, ref, sizes)
        # each file hashed from the bytes the save reads, in file order where they arrive so
        self.hashers = {name: PrefixHasher(sizes[name], self.repo.where(name)) for name in files}
        for name, head in self.heads.items():
            self.hashers[name].feed(0, head)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def downloads(self) -> Meter:
        return self.meter

    def _header(self, name: str) -> tuple[dict[str, TensorInfo], int, str | None]:
        head = bytearray(8)
        remote = self.repo.fetch(name, 0, memoryview(head))
        (n,) = struct.unpack("<Q", head)
        where = self.repo.where(name)
        if n > remote.size - 8 or n > MAX_HEADER:
            raise SourceError(
                f"{where}: corrupt safetensors header (length {n}, file {remote.size} bytes)",
                "the Hub (or a proxy or CDN before it) served other bytes than the file's: run again later, "
                "or check HF_ENDPOINT",
            )
        raw = bytearray(n)
        self.repo.fetch(name, 8, memoryview(raw))
        found, _, size = parse_header(bytes(raw), remote.size, where, name)
        self.heads[name] = bytes(head + raw)
        return found, size, remote.etag

    def open_reader(self) -> Reader:
        try:
            return self._open_reader()
        except OSError as e:  # the cache, not the output: say so (and how to do without it)
            raise SourceError(f"cannot write the Hugging Face cache: {e}", "use `save --stream` or set HF_HOME") from e

    def _open_reader(self) -> Reader:
        ckpt = self._checkpoint
        if not self.stream and not self.blobs:
            storage = _storage(ckpt)
            (storage / "blobs").mkdir(parents=True, exist_ok=True)
            for name in ckpt.files:
                blob = Blob(storage / "blobs" / self._blob_name(name), ckpt.file_sizes[name])
                if blob.busy:  # another process fills it: this file is read as --stream reads it
                    self.others[name] = blob
                    continue
                self.blobs[name] = blob
                if not blob.put_head(self.heads[name]):
                    raise SourceError(
                        f"{self.repo.repo_id}/{name}@{self.repo.commit[:12]}: the cached {blob.final} holds another "
                        "safetensors header than the Hub serves for it: corrupt or changed",
                        f"delete {blob.final} and run again",
                    )
            need = sum(b.missing() for b in self.blobs.values())
            free = shutil.disk_usage(storage / "blobs").free
            if need > free:
                raise SourceError(
                    f"the Hugging Face cache ({storage}) has {free / 1e9:.1f} GB free; "
                    f"the source needs {need / 1e9:.1f} GB more",
                    "use `save --stream` (stores nothing) or point HF_HOME at a larger disk",
                )
            self.meter.total = need + sum(ckpt.file_sizes[f] for f in ckpt.files if f not in self.blobs)
        elif self.stream:
            self.meter.total = ckpt.total_bytes
        if len(self.blobs) < len(self.hashers) and self.spill is None:  # files stored nothing of
            budget, why = usable(settings.STREAM_SPILL.get())
            self.spill = Spill(budget, why)
            spilling = [h for name, h in self.hashers.items() if name not in self.blobs]
            for hasher in spilling:
                hasher.spill = self.spill
                if budget:  # what waits beyond one file's bound in memory, all files together, waits on disk
                    hasher.limit = prefixhash.PENDING // len(spilling)
        return HubReader(self.repo, self.blobs, Groups(ckpt.tensors, self.repo.where), self.hashers, self.spill)

    def _want(self, name: str) -> tuple[str, str] | None:
        """What `name`'s bytes must hash to, and how (hubsmall.expected): the commit's LFS sha256; for a
        file stored in git (no LFS), its git blob sha1, the model info's blob id; else the Hub's ETag
        where it is one of those hashes. It names the blob in the cache too, as huggingface_hub names it:
        never another string the server sent (an absolute or `../` ETag would put the file anywhere
        this user can write)."""
        lfs, etag = self.repo.lfs.get(name), self.etags.get(name)
        if lfs is not None:  # an LFS file: its git blob id is its pointer's
            return expected(lfs, None) or expected(etag, None)
        return expected(None, self.repo.blob_ids.get(name)) or expected(etag, etag)

    def _blob_name(self, name: str) -> str:
        """The cache's name for `name`'s blob: the hash its bytes are checked against."""
        want = self._want(name)
        if want is not None:
            return want[0]
        raise SourceError(
            f"{self.repo.repo_id}/{name}: the Hub names no sha256 for it (ETag {str(self.etags.get(name))[:80]!r}), "
            "so it has no name in the Hugging Face cache",
            "use `save --stream` (stores nothing), or check HF_ENDPOINT",
        )

    def finish(self) -> None:
        """After a successful save: check each file's sha256 (the bytes no tensor needed fetched,
        or read from the blob); cached mode: complete each blob and link it into the snapshot."""
        if not self.stream:  # this run's blobs first: another run filling the same cache may be waiting for them
            try:
                self._finish()
            except OSError as e:
                raise SourceError(
                    f"cannot complete the Hugging Face cache: {e}", "use `save --stream` or set HF_HOME"
                ) from e
        try:
            for name in self._checkpoint.files:  # stored nothing of (--stream, or another process fills its blob)
                if name not in self.blobs:
                    self._verify(name, self._rest_of(name))
        finally:
            if self.spill is not None:
                self.spill.close()
        order = {name: i for i, name in enumerate(self._checkpoint.files)}
        self._checkpoint.checked.sort(key=lambda record: order[record.name])

    def _rest_of(self, name: str) -> Callable[[int, memoryview], None]:
        """How `name`'s sha256 reads the rest: from the blob another run here publishes (not fetched again)."""
        other = self.others.get(name)
        final = published_by_another(other, settings.HUB_TIMEOUT.get()) if other is not None else None
        if final is None:
            return lambda pos, buf: self.repo.fetch(name, pos, buf, self.meter.add)
        self.meter.total -= self.hashers[name].unread()  # not downloaded after all
        return read_from(final)

    def _finish(self) -> None:
        ckpt = self._checkpoint
        assert ckpt.root is not None
        bad: list[SourceError] = []
        for name, blob in self.blobs.items():
            for a, b in blob.gaps():
                for pos in range(a, b, _FILL):
                    buf = memoryview(bytearray(min(_FILL, b - pos)))
                    self.repo.fetch(name, pos, buf, self.meter.add)
                    blob.store(buf, pos)
                    self.hashers[name].feed(pos, buf)
            partial = blob.partial.exists()
            hint = "run again: the wrong partial download was deleted" if partial else f"delete {blob.final}"
            try:
                self._verify(name, lambda pos, buf, blob=blob: blob.pread(buf, pos), hint)
            except SourceError as e:
                blob.discard()  # a partial blob that holds wrong bytes: the next run downloads it anew
                bad.append(e)
        if bad:  # every file checked (and each wrong partial blob deleted) before the first is named
            raise bad[0]
        for name, blob in self.blobs.items():
            blob.publish(ckpt.root / name)
            blob.close()
        if self.repo.revision != self.repo.commit:
            refs = _storage(ckpt) / "refs"
            refs.mkdir(exist_ok=True)
            (refs / self.repo.revision).write_text(self.repo.commit)

    def _verify(self, name: str, read, hint: str = "run again") -> None:
        """`name`'s sha256 against the LFS sha256 of the commit (or, stored in git, its git blob sha1);
        its record for the manifest."""
        got = self.hashers[name].rest(read)
        want = self._want(name)
        size = self._checkpoint.file_sizes[name]
        where = self.repo.where(name)
        if want is None:
            self._checkpoint.checked.append(SourceFileRecord(name, size, got, UNCHECKED))
            return
        if want[1] == "git":  # read once more, whole: the Hub keeps files over 10 MB in LFS
            sha256, sha1 = whole_digests(read, size)
            if sha256 != got:
                raise SourceError(
                    f"{where}: read twice, it gave other bytes the second time (sha256 {got[:12]}…, "
                    f"then {sha256[:12]}…)",
                    f"{hint}; nothing was published",
                )
            if sha1 != want[0]:
                raise SourceError(
                    f"{where}: git blob sha1 {sha1[:12]}… is not the commit's blob id ({want[0][:12]}…): "
                    "corrupt or changed",
                    f"{hint}; nothing was published",
                )
            self._checkpoint.checked.append(SourceFileRecord(name, size, got, GIT))
            return
        if got != want[0]:
            raise mismatch(where, got, want[0], HUB, f"{hint}; nothing was published")
        self._checkpoint.checked.append(SourceFileRecord(name, size, got, HUB))


def _storage(ckpt: Checkpoint) -> Path:
    assert ckpt.root is not None
    return ckpt.root.parent.parent  # <cache>/models--org--name/snapshots/<commit>


class HubReader(AlignedReader):
    """Ranges of a repo's weight files from the Hub (or from the cached blob, where it has them)."""

    def __init__(
        self,
        repo: HubRepo,
        blobs: dict[str, Blob],
        groups: Groups,
        hashers: dict[str, PrefixHasher],
        spill: Spill | None = None,
    ) -> None:
        self.spill = spill
        self.threads = settings.HUB_CONNECTIONS.get()  # the prefetcher's reads in flight: HTTP connections
        self.repo = repo
        self.blobs = blobs
        self.groups = groups
        self.hashers = hashers
        self.shares = Shares(repo.where)

    def expect(self, reads: Sequence[ByteRange]) -> None:
        """The bytes that several of the reads to come use (grouped tensors aside: their group is
        fetched once), to be fetched once (reshard.sources.hubshare)."""
        of = self.groups.of
        self.shares.plan(
            (r.info.file, r.info.offset + r.start, r.info.offset + r.start + r.nbytes)
            for r in reads
            if r.info.name not in of
        )
        if len(self.blobs) < len(self.hashers):  # files stored nothing of: what their hash takes in again is fetched
            self._foresee([r for r in reads if r.info.file not in self.blobs], told=not self.blobs)

    def _foresee(self, reads: Sequence[ByteRange], told: bool) -> None:
        """The bytes a save will fetch a second time for the sha256 of the files it stores nothing of (reads
        far ahead of the hash's position in their file: an MoE release's experts, stored by name), counted
        in the download's progress and, `told` (--stream), said in a note when they are many."""
        of, seen = self.groups.of, set()

        def ranges() -> Iterator[tuple[str, int, int]]:
            for r in reads:
                key = of.get(r.info.name)
                if key is None:
                    yield r.info.file, r.info.offset + r.start, r.info.offset + r.start + r.nbytes
                elif key not in seen:  # a group of small tensors: fetched and fed whole, at its first use
                    seen.add(key)
                    yield key

        budget = self.spill.budget if self.spill is not None else None
        with paused_gc():
            limits = [h.limit for name, h in self.hashers.items() if name not in self.blobs and h.limit is not None]
            at = {name: h.pos for name, h in self.hashers.items()}
            again = taken_again(ranges(), min(limits, default=None), at, spill=budget)
        total = self.repo.meter.total
        self.repo.meter.total += again
        if told and total and again > total // 20:
            why = (self.spill.why if self.spill is not None else None) or (
                f"at most {human_bytes(budget)} of them wait on disk (RESHARD_STREAM_SPILL)"
                if budget
                else "none of them waits on disk (RESHARD_STREAM_SPILL=0)"
            )
            note(
                f"--stream: this checkpoint's files hold its tensors in another order than the save uses "
                f"them (an MoE's experts, stored by name); about {human_bytes(again)} of its {human_bytes(total)} "
                f"will be fetched a second time for the Hub's sha256 check: {why}. Without --stream the Hugging "
                "Face cache keeps them and the check reads them back from disk."
            )

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        out = memoryview(buf)[:nbytes] if buf is not None else memoryview(bytearray(nbytes))
        pos = t.offset + start
        key = self.groups.of.get(t.name)
        if key is None:
            self.shares.read(t.file, pos, out, self._get, self.hashers[t.file].feed)
            return out
        data = self.groups.get(key, lambda buf, again: (self._get if again else self._fill)(t.file, key[1], buf))
        out[:] = memoryview(data)[pos - key[1] : pos - key[1] + nbytes]
        return out

    def _fill(self, file: str, pos: int, out: memoryview) -> None:
        """Bytes [pos, pos + len(out)) of `file`: from the cached blob where it has them, else fetched
        (and stored in the blob); hashed on the way."""
        self._get(file, pos, out)
        self.hashers[file].feed(pos, out)

    def _get(self, file: str, pos: int, out: memoryview) -> None:
        blob = self.blobs.get(file)
        if blob is not None:  # what an earlier run received comes from disk (a range cut mid-way: its start)
            held = min(blob.held_from(pos), pos + len(out)) - pos
            if held:
                blob.pread(out[:held], pos)
                out, pos = out[held:], pos + held
            if not len(out):
                return
        try:
            self.repo.fetch(file, pos, out, self.repo.meter.add)
        except SourceError as e:
            got = getattr(e, "got", 0)
            if blob is not None and got:  # what did arrive is kept: a rerun resumes after it
                with contextlib.suppress(OSError):
                    blob.store(out[:got], pos)
            raise
        if blob is not None:
            try:
                blob.store(out, pos)
            except OSError as e:
                raise SourceError(
                    f"cannot write the cache ({blob.partial}: {e.strerror})", "use `save --stream` or free space"
                ) from e

    def prepare(self, t: TensorInfo, start: int, nbytes: int) -> Prepared:
        return Prepared(None, t.offset + start, nbytes)

    def read_prepared(
        self, t: TensorInfo, start: int, nbytes: int, prepared: Prepared, region: memoryview
    ) -> memoryview:
        return self.read(t, start, nbytes, region)

    def close(self) -> None:
        pass  # the blobs stay open for `finish`; the source closes them
