"""Stream the plan: read each source tensor once, write every rank's files header first.

All ranks advance together through one global tensor order, so each output file is written
sequentially (and hashed on the fly) while each source tensor is read once, in row chunks, and its
rows handed to every rank that needs them. Nothing is assembled whole.

The order of everything is computed once, before any I/O, as a `schedule`: a list of `Step`s, one
per tensor name, each with the source `Read`s it makes, in order, and who consumes each read. The
reader threads read ahead through that list, and the main thread emits from the same list, so the
two cannot disagree.

Threads overlap so that a save runs at the disk's speed (docs/benchmarks.md):

- READ_THREADS reader threads (`reshard.io.prefetch`) read the source ranges ahead, in exactly the
  order they will be used, into reused page-aligned buffers; several reads in flight keep the
  device busy, also through the thousands of small tensors of an MoE checkpoint. A file in the
  page cache is read out of it, one that is not with O_DIRECT (RESHARD_DIRECT_READS,
  `reshard.io.reader`);
- the main thread (here) takes those chunks in order and hands every rank *views* of its rows: no
  copy. An MoE layer's experts (a uniform step: hundreds of small reads of one shape, each rank
  taking the same slice of each) go in batches (`reshard.batch`): small reads copied into a reused
  batch buffer, each rank's share of a batch handed over as one view. Where those reads' files are
  in the page cache, the main thread copies them out of it into the batch buffer itself, not
  through the reader threads: at 200k reads of a few KB the threads' hand-over of each read cost
  more than the read; where a layer's experts tile a stretch of a file, the reader threads read the
  stretch ahead, whole, and the main thread copies the reads out of it (`reshard.spans`);
- one writer thread per open output file (`reshard.io.worker`) gathers strided views (column
  slices) into an aligned stage and hashes it (BLAKE3 by default); contiguous views that line up
  with the file go to disk from the read buffer itself. That file's I/O thread writes with O_DIRECT
  where the filesystem allows it (`reshard.io.writer`). I/O, copies and hashes release the GIL.

Memory is bounded by `max_memory` (`reshard.io.memory`): a fixed set of reused chunk buffers plus a
byte budget for the rare pieces that are fresh arrays (dtype casts, up-sampled scales, fills), plus
two staging buffers per open output file. Readers wait for buffers, the main thread for budget;
writers never wait on memory, so all waits end. Under `reshard save` the checkpoint's metadata
(headers, plan, schedule: a few hundred MB for a 200k-tensor MoE) counts inside `max_memory`: the
buffers get what the process grew by since the command began leaves of it (`WriteOptions.rss_base`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from reshard.batch import Batches, Uniform, uniform
from reshard.checkpoint import Reader, Source
from reshard.format import ITEMSIZE, TensorInfo
from reshard.io.dtypes import Caster, dequantize_fp8, fill_bytes, pad_rows, upsample
from reshard.io.memory import ALIGN, Lease, Memory, metadata_budget
from reshard.io.prefetch import Prefetcher
from reshard.io.worker import Worker
from reshard.io.writer import FileWriter, Sink, Written
from reshard.plan import Cols, Fill, OutFile, OutTensor, Plan, Slice, flat
from reshard.schedule import ALL_ROWS, DEFAULT_CHUNK, Read, Step, bounds, file_header, schedule, shape_of
from reshard.spans import InlineReads, ReadBatch

# ---- the executor ----------------------------------------------------------------------------------


class _Holder:
    """One rank's copy of the tensor being written, and how far its pieces have been emitted."""

    __slots__ = ("cursor", "parts", "tensor", "writer")

    def __init__(self, tensor: OutTensor, writer: Worker) -> None:
        self.tensor = tensor
        self.writer = writer
        self.cursor = 0
        self.parts: list[np.ndarray] = []  # a Cols piece's parts read so far


@dataclass(frozen=True)
class WriteOptions:
    """How the executor writes (its defaults are the CLI's: reshard.commands.options).

    checksum: the default sink's hash (`reshard.hashing.ALGORITHMS`).
    max_memory: about how many bytes of tensor data may be in memory at once: reused buffers and
        fresh arrays (at least 2 chunks); each open output file adds STAGE_BYTES on top.
    device: where each piece is materialised before writing (cpu, cuda).
    chunk_bytes: source rows are read this many bytes at a time (the reused buffers' size).
    rss_base: the process's resident bytes before the checkpoint's metadata was read (the save
        command's start): what the process grew by since (headers, plan, schedule) counts inside
        max_memory (`reshard.io.memory.metadata_budget`); None: max_memory is for tensor data alone.
    """

    checksum: str
    max_memory: int
    device: str = "cpu"
    chunk_bytes: int = DEFAULT_CHUNK
    rss_base: int | None = None


Progress = Callable[[int], None]  # called with the bytes written since the last call


def run_executor(
    plan: Plan,
    source: Source,
    out: Path | None,
    options: WriteOptions,
    metadata: dict[str, str],
    progress: Progress | None,
    *,
    sink: Callable[[OutFile, bytes, str], Sink] | None = None,
    name_key: str | None = None,
) -> list[Written]:
    """Write `plan`'s files into the folder `out` (or each into `sink(file, header, checksum)`),
    reading through the source's own reader; then let the source finish what it keeps of what it
    read (a Hub source completes its cache copy). `name_key`: the metadata key under which each
    file's header records its own name."""
    opener = None
    if sink is not None:
        opener = lambda f, header: sink(f, header, options.checksum)  # noqa: E731
    written = Executor(
        plan,
        source.open_reader(),
        source.checkpoint.tensors,
        out or Path(),
        options,
        metadata=metadata,
        progress=progress,
        sink=opener,
        name_key=name_key,
    ).run()
    source.finish()
    return written


class Executor:
    """Writes a plan's files (see the module docstring for how).

    reader: the source's bytes (`FileReader(root)` for a local checkpoint, or another source's
        reader); the executor closes it at the end of `run`.
    tensors: the source tensors by name.
    sink: makes each output file's sink from (file, header); default: a `FileWriter` in out_dir.
    """

    def __init__(
        self,
        plan: Plan,
        reader: Reader,
        tensors: dict[str, TensorInfo],
        out_dir: Path,
        options: WriteOptions,
        *,
        metadata: dict[str, str],
        progress: Progress | None = None,
        sync: bool = True,
        sink: Callable[[OutFile, bytes], Sink] | None = None,
        name_key: str | None = None,
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.out_dir = out_dir
        self.metadata = metadata
        self.name_key = name_key
        self.reader = reader
        self.cast = Caster(options.device)
        max_memory, checksum = options.max_memory, options.checksum
        self.options = options
        self.chunk_bytes = max(1, min(options.chunk_bytes, max_memory // 4))  # leave room for a few in flight
        self.progress = progress or (lambda n: None)
        self.sync = sync
        self.sink = sink or (lambda f, header: FileWriter(self.out_dir / f.name, header, checksum))
        self.open: dict[str, Worker] = {}
        self.closing: list[Worker] = []
        self.done: list[Written] = []
        self.prefetch: Prefetcher | None = None
        self.batches: Batches | None = None
        self.scales: dict[str, np.ndarray] = {}  # the step's block scales (Read.scale), by name

    def header(self, f: OutFile) -> bytes:
        """`f`'s safetensors header: the run's metadata, and `f`'s own name under `name_key`."""
        meta = self.metadata if self.name_key is None else {**self.metadata, self.name_key: f.name}
        return file_header(f, meta)

    def run(self) -> list[Written]:
        steps = schedule(self.plan, self.tensors, self.chunk_bytes)
        # the budget left once the metadata (headers, plan, these steps) is resident
        budget = metadata_budget(self.options.max_memory, self.options.rss_base)
        self.mem = Memory(budget, self.chunk_bytes)
        self.mem.on_short = self._flush_held
        # the uniform steps' two batch buffers: taken out of the fresh budget (Memory.reserve) when first used
        self.batch_bytes = min(self.chunk_bytes, self.mem.fresh_limit // 8)  # two, reserved: a quarter
        for f in self.plan.files:
            if not f.tensors:
                self.done.append(self.sink(f, self.header(f)).close(self.sync))
        reads: InlineReads | None = None
        try:
            uniforms = [uniform(step, [t for _, t in step.slots], self.batch_bytes) for step in steps]
            reads = InlineReads(self.reader, steps, [u is not None for u in uniforms])
            # stretches steps read whole (reshard.spans): in the reader threads' buffers (a page more
            # at each end with O_DIRECT), each step's reads in a batch
            reads.plan(self.batch_bytes - 2 * ALIGN)
            self.batches = Batches(self.mem, self.batch_bytes, self.cast, self.progress)
            self.prefetch = Prefetcher(self.reader, self.mem, reads.ahead)
            self.batches.get = reads.get = self.prefetch.get
            for k, (step, u) in enumerate(zip(steps, uniforms, strict=True)):
                read_batch = reads.at(k)
                holders = [_Holder(t, self._writer(f)) for f, t in step.slots]
                for h in holders:
                    h.writer.begin(h.tensor)
                self._emit(step, holders, u, read_batch)
                for name in step.closes:
                    w = self.open.pop(name)
                    w.close(self.sync)
                    self.closing.append(w)
            for w in self.closing:
                self.done.append(w.join())
        except BaseException:
            workers = [*self.open.values(), *self.closing]
            for w in workers:
                w.abort()
            if self.prefetch is not None:
                self.prefetch.stop()
            for w in workers:
                w.thread.join()
            raise
        finally:
            if reads is not None:
                reads.close()
            if self.batches is not None:
                self.batches.close()
            if self.prefetch is not None:
                self.prefetch.stop()
            self.reader.close()
            self.mem.close()
        return self.done

    def _flush_held(self) -> None:
        """Memory is short (a reader or the main thread waits): writers write what they hold."""
        for w in list(self.open.values()):
            w.flush_held()

    def _writer(self, f: OutFile) -> Worker:
        if f.name not in self.open:
            self.open[f.name] = Worker(self.sink(f, self.header(f)))
        return self.open[f.name]

    # ---- one step: a tensor name, all ranks ----------------------------------------------------

    def _emit(self, step: Step, holders: list[_Holder], u: Uniform | None, read_batch: ReadBatch | None) -> None:
        """Take the step's reads from the prefetcher, in order (or, for the uniform step `u` where
        given, with `read_batch`: `AlignedReader.read_batch`, `spans.copy_reads`), and emit every
        holder's pieces."""
        assert self.prefetch is not None and self.batches is not None
        if u is not None:
            self.batches.emit(step.reads, holders, u, read_batch)
            return
        for h in holders:  # a piece at a time: experts' stacks as their slices (the reads are the same)
            pieces = flat(h.tensor.pieces)
            if pieces is not h.tensor.pieces:  # most tensors hold no stack: no new record (dataclasses.replace: ~10 us)
                h.tensor = replace(h.tensor, pieces=pieces)
        for read in step.reads:
            view, lease = self.prefetch.get()
            info = read.info
            item = ITEMSIZE[info.dtype]
            if read.rows is None:
                arr = np.frombuffer(view, np.uint8).reshape((*shape_of(info), item))
            else:
                arr = np.frombuffer(view, np.uint8).reshape((read.rows[1] - read.rows[0], *shape_of(info)[1:], item))
            if read.scale:
                self.scales[info.name] = arr.copy()
            elif read.piece is None:
                self._feed(holders, read, arr, lease)
            else:
                self._emit_piece(holders, *read.piece, arr, lease)
            del arr, view
            lease.release()
        for h in holders:
            self._advance_fills(h)
            if h.cursor != len(h.tensor.pieces):
                raise AssertionError(f"{h.tensor.name}: pieces left unwritten")
        self.scales.clear()

    def _advance_fills(self, h: _Holder) -> None:
        pieces = h.tensor.pieces
        while h.cursor < len(pieces) and isinstance(pieces[h.cursor], Fill):
            self._write_fill(h, pieces[h.cursor])
            h.cursor += 1

    def _feed(self, holders: list[_Holder], read: Read, arr: np.ndarray, lease: Lease) -> None:
        """Hand the read's rows [c0, c1) of its source (as uint8 array [rows, ..., itemsize]) to
        every holder, each as far as its pieces use them."""
        source, src_dtype = read.info.name, read.info.dtype
        c0, c1 = read.rows or (0, ALL_ROWS)
        upsampled: dict[tuple[int, ...], np.ndarray] = {}  # every rank's scale piece from one up-sampling
        for h in holders:
            pieces = h.tensor.pieces
            while True:
                self._advance_fills(h)
                if h.cursor >= len(pieces):
                    break
                p = pieces[h.cursor]
                assert isinstance(p, Slice)
                if p.source != source:
                    break
                a, b = bounds(p)
                if p.up:
                    if p.up not in upsampled:
                        upsampled[p.up] = upsample(arr, p.up)
                    part = upsampled[p.up][tuple(slice(x, y) for x, y in zip(a, b, strict=True))]
                    self._write(h, part, src_dtype, None)
                    h.cursor += 1
                    continue
                if a[0] >= c1:
                    break
                r0, r1 = max(a[0], c0), min(b[0], c1)
                if r1 > r0:
                    idx = (slice(r0 - c0, r1 - c0), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                    if p.scale:
                        self._write_dequantized(h, arr[idx], read.info, p, r0)
                    else:
                        self._write(h, arr[idx], src_dtype, lease, p)
                if b[0] <= c1:
                    h.cursor += 1
                    continue
                break

    def _emit_piece(self, holders: list[_Holder], hi: int, i: int, arr: np.ndarray, lease: Lease) -> None:
        """A tensor one pass cannot serve: write piece `i` of holder `hi` from its own read. Holders
        are served one after the other, each piece in order, fills as they come."""
        for g in holders[:hi]:
            self._advance_fills(g)  # those served before: their remaining fills (holders of fills only)
        h = holders[hi]
        self._advance_fills(h)
        assert h.cursor == i
        p = h.tensor.pieces[i]
        if isinstance(p, Cols):
            q = p.parts[len(h.parts)]
            a, b = bounds(q)
            idx = tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True))
            h.parts.append(self.cast(arr[(slice(None), *idx)], self.tensors[q.source].dtype, h.tensor.dtype).copy())
            if len(h.parts) < len(p.parts):
                return
            out = np.concatenate(h.parts, axis=-2)  # the last dim before the item's bytes
            h.parts = []
            h.writer.write(out, self.mem.account(out.nbytes))
            self.progress(out.nbytes)
            h.cursor += 1
            self._advance_fills(h)
            return
        assert isinstance(p, Slice)
        a, b = bounds(p)
        src_dtype = self.tensors[p.source].dtype
        if p.up:
            idx = tuple(slice(x, y) for x, y in zip(a, b, strict=True))
            self._write(h, upsample(arr, p.up)[idx], src_dtype, None, p if p.perm else None)
        else:
            idx = (slice(None, None, p.step), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
            if p.scale:
                self._write_dequantized(h, arr[idx], self.tensors[p.source], p, a[0])
            else:
                self._write(h, arr[idx], src_dtype, lease, p)
        h.cursor += 1
        self._advance_fills(h)

    def _write(
        self, h: _Holder, part: np.ndarray, src_dtype: str, lease: Lease | None, piece: Slice | None = None
    ) -> None:
        """Queue `part` for h's writer; `lease`: what `part` is a view of (None: a fresh array);
        `piece`: a padded Slice's trailing dims are filled out here."""
        if piece is not None and piece.perm is not None:
            part = np.transpose(part, (*piece.perm, part.ndim - 1))  # the last axis is the item's bytes
        out = self.cast(part, src_dtype, h.tensor.dtype)
        if piece is not None and piece.pad is not None:
            out = pad_rows(out, piece.pad, piece.fill, h.tensor.dtype)
        if out is part and lease is not None:
            lease.hold()
            h.writer.write(out, lease)
        else:  # cast or up-sampled: a fresh array with its own budget share
            h.writer.write(out, self.mem.account(out.nbytes))
        self.progress(out.nbytes)

    def _write_dequantized(self, h: _Holder, part: np.ndarray, info: TensorInfo, p: Slice, row: int) -> None:
        """Rows [row, row + len(part)) (columns from p.start[1]) of the FP8 source `info`, dequantised
        with the step's block scale p.scale to bfloat16 as vLLM does, then cast to h's dtype."""
        assert p.scale is not None
        scale = self.tensors[p.scale]
        out = dequantize_fp8(part, info.shape, self.scales[p.scale], scale.dtype, scale.shape, row, p.start[1])
        self._write(h, out, "BF16", None)

    def _write_fill(self, h: _Holder, p: Fill) -> None:
        data = fill_bytes(p.value, p.count, h.tensor.dtype)
        h.writer.write(data, self.mem.account(len(data)))
        self.progress(len(data))
