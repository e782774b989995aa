"""A reshard output folder read as the checkpoint it was made from.

The manifest records the source's tensor names, dtypes and shapes; planning the recorded layout
again tells, for every piece of every output tensor, which region of which source tensor it holds.
From those regions any row range of a source tensor can be read back out of the rank files (KV
replicas and replicated tensors are read once; up-sampled FP8 scales are taken back down). This
serves `save` with an output as SOURCE (re-shard without the original) and `merge` (back to HF).

The output is read through a `FolderView`: a local folder here, a bucket folder (`s3://...`) in
`reshard.sources.bucket_output`.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reshard.checkpoint import Checkpoint, Reader, Source
from reshard.errors import CorruptError, SourceError, UnsupportedError
from reshard.folderview import FolderView, LocalView, view_manifest
from reshard.format import ITEMSIZE, TensorInfo, open_regular, records
from reshard.hashing import NONE, hash_fd
from reshard.manifest import FileRecord, Manifest, SideRecord
from reshard.names import FILE_NAME_META, unlisted_rank_files
from reshard.plan import Cols, OutTensor, Piece, Slice, Stack, build_plan, natural_key
from reshard.sources.local import read_config
from reshard.sources.output_reader import Group, OutputReader, Region, Regions

VIRTUAL = "<reshard-output>"
_WHOLE = 1 << 62  # a part size no rank reaches: one planned file per rank


class OutputSource(Source):
    """An output folder (checked whole against its manifest first) whose tensors are read back out of
    its rank files."""

    def __init__(self, path: Path, *, checksums: bool = True) -> None:
        self.path = path
        view = LocalView(path)
        manifest = view_manifest(view)
        check_complete(str(path), manifest)
        if checksums:
            check_files(path, manifest)
            if manifest.checksum == NONE:
                from reshard.console import note

                note(
                    f"{path} was saved with --checksum none: its files' sizes were checked, not their bytes "
                    "(a damaged or swapped rank file is read as it is)"
                )
        ref = {"path": str(path.resolve())}
        self._checkpoint, self.regions = read_output(view, manifest, path, ref)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def open_reader(self) -> Reader:
        return OutputReader(self.path, self.regions)


def read_output(view: FolderView, manifest: Manifest, root: Path, ref: dict) -> tuple[Checkpoint, Regions]:
    """The original checkpoint's metadata, and where each of its tensors lies in the rank files.

    root: a local folder holding the output's side files (config.json, tokenizer, ...)."""
    path = view.display
    config = read_config(root)
    # --dtype auto on a re-shard means the dtype the output holds, not the original's
    config = {**config, "torch_dtype": manifest.layout.dtype, "dtype": manifest.layout.dtype}
    if manifest.source_tensors is None:
        raise SourceError(
            f"{path}: its manifest records no source tensors (written by an older reshard)",
            "re-shard or merge from the original Hugging Face checkpoint",
        )
    original = records(manifest.source_tensors, VIRTUAL)
    # every rank's tensors, planned again; which file of the rank holds each is the manifest's to say
    # (the --max-part-size the output was saved with is not recorded, and split them as it did)
    old = build_plan(
        Checkpoint(None, config, original, [VIRTUAL], manifest.source), manifest.layout, max_part_size=_WHOLE
    )
    check_complete(path, manifest)
    planned = {(f.pp_rank, f.tp_rank): {t.name: t for t in f.tensors} for f in old.files}
    held: dict[tuple[int, int], list[str]] = {}
    for mf in manifest.files:
        held.setdefault(mf.rank, []).extend(r.name for r in mf.tensors)
    for rank, tensors_of_rank in planned.items():
        names = held.get(rank, [])
        if sorted(names) != sorted(tensors_of_rank):
            odd = sorted(set(names) ^ set(tensors_of_rank)) or ["a tensor listed twice"]
            raise CorruptError(
                f"{path} is not a complete reshard output: the files of pp rank {rank[0]}, tp rank {rank[1]} do not hold the "
                f"tensors its layout gives that rank ({odd[0]})",
                "run `reshard verify` on it, or reshard the original checkpoint",
            )
    plain: dict[str, list[Region]] = {}
    dtypes: dict[str, str] = {}
    stacks: dict[tuple[str, ...], list] = {}  # a Stack's sources -> [dtype, its parts]
    for f in manifest.files:
        header, meta, _ = view.header(f.name)
        _check_file_meta(view, f.name, meta, manifest)
        for t in (planned[f.rank][r.name] for r in f.tensors):
            if t.name not in header:
                raise CorruptError(f"{view.where(f.name)}: tensor {t.name} is missing", "the output is damaged")
            _check_as_planned(view, f.name, header[t.name], t, manifest)
            pos = header[t.name].offset
            for p in t.pieces:
                if type(p) is Stack:  # a layer's experts on this rank (issue 28): kept as one part
                    size = math.prod(b - a for a, b in zip(p.start, p.stop, strict=True)) * ITEMSIZE[t.dtype]
                    entry = stacks.setdefault(p.sources, [t.dtype])
                    if entry[0] != t.dtype:
                        raise SourceError(f"{p.sources[0]} is stored in two dtypes; cannot read it back")
                    entry.append((f.name, pos, p.start, p.stop, size))
                    pos += size * len(p.sources)
                else:
                    pos = _piece_regions(path, f.name, pos, p, t.dtype, plain, dtypes)
    stacked = _groups(original, stacks, plain, dtypes)
    sizes: dict = {}
    for name, regs in plain.items():
        plain[name] = _tile(name, original[name].shape, regs, sizes)
    tensors = {}
    for name, info in original.items():
        held = stacked.get(name)
        dtype = held[0].dtype if held is not None else dtypes.get(name)
        if dtype is not None:
            tensors[name] = TensorInfo(name, dtype, info.shape, VIRTUAL, 0, math.prod(info.shape) * ITEMSIZE[dtype])
    ref = {**ref, "resharded_from": manifest.source, "from_run": manifest.run_id}
    ckpt = Checkpoint(root, config, tensors, [], ref, manifest=manifest, missing=sorted(set(original) - set(tensors)))
    return ckpt, Regions(plain, stacked)


_EDITED = (
    "run `reshard verify` on it (the manifest was edited, or the files are another output's), or reshard the "
    "original checkpoint"
)


def _check_file_meta(view: FolderView, name: str, meta: dict, manifest: Manifest) -> None:
    """A rank file's own record of its run and layout (its safetensors metadata) is the manifest's."""
    run, tag = meta.get("reshard_run"), meta.get("reshard_layout")
    if run is not None and run != manifest.run_id:
        raise CorruptError(
            f"{view.where(name)} was written by run {run}, the manifest by run {manifest.run_id}", _EDITED
        )
    named = meta.get(FILE_NAME_META)
    if named is not None and named != name:
        raise CorruptError(f"{view.where(name)} was written as {named}: rank files were renamed or swapped", _EDITED)
    if tag is not None and tag != manifest.layout.tag():
        raise CorruptError(
            f"{view.where(name)} was written for layout {tag}, the manifest says {manifest.layout.tag()}", _EDITED
        )


def _check_as_planned(view: FolderView, name: str, held: TensorInfo, t: OutTensor, manifest: Manifest) -> None:
    """A rank file's tensor is of the dtype and shape the manifest's layout plans for it: a layout edited in
    the manifest (another dtype, --ep, MoE backend) would read the bytes back as other tensors."""
    if held.dtype != t.dtype or tuple(held.shape) != tuple(t.shape):
        raise CorruptError(
            f"{view.where(name)}: tensor {t.name} is {held.dtype} {list(held.shape)}, the manifest's layout "
            f"({manifest.layout}) gives {t.dtype} {list(t.shape)}",
            _EDITED,
        )


def _groups(
    original: dict[str, TensorInfo], stacks: dict[tuple[str, ...], list], plain: dict[str, list[Region]], dtypes: dict
) -> dict[str, tuple[Group, int]]:
    """The stacks as `Group`s (each source -> its group and index), replicas dropped and coverage
    checked once per group. A stack some source of which is held elsewhere too, or whose sources
    differ in shape, is made into plain regions instead (checked by `_tile` with the rest)."""
    seen: dict[str, int] = {}
    for sources in stacks:
        for s in sources:
            seen[s] = seen.get(s, 0) + 1
    stacked: dict[str, tuple[Group, int]] = {}
    for sources, (dtype, *parts) in stacks.items():
        shape = original[sources[0]].shape
        if all(seen[s] == 1 and s not in plain and original[s].shape == shape for s in sources):
            first: dict[tuple, tuple] = {}
            for part in parts:  # replicas (the same slice on two ranks) read once
                first.setdefault((part[2], part[3]), part)
            unique = tuple(first.values())
            covered = sum(math.prod(y - x for x, y in zip(a, b, strict=True)) for _, _, a, b, _ in unique)
            if covered != math.prod(shape):
                raise SourceError(f"{sources[0]}: the output's pieces do not cover it exactly; cannot read it back")
            group = Group(sources, dtype, shape, unique)
            stacked.update((s, (group, k)) for k, s in enumerate(sources))
            continue
        for f, off, a, b, size in parts:
            for k, s in enumerate(sources):
                if dtypes.setdefault(s, dtype) != dtype:
                    raise SourceError(f"{s} is stored in two dtypes; cannot read it back")
                plain.setdefault(s, []).append(Region(f, off + k * size, a, b, None, None))
    return stacked


def _piece_regions(
    path: str, file: str, pos: int, p: Piece, dtype: str, regions: dict[str, list[Region]], dtypes: dict[str, str]
) -> int:
    """The regions of piece `p` at `pos` of `file`; where it ends."""
    if isinstance(p, Slice):
        if p.perm is not None or p.step > 1:
            raise UnsupportedError(
                f"{path} holds {p.source} transposed or with its rows reordered (vLLM's layout of "
                "gpt-oss's and Llama-4's bf16 experts, Llama-4's q/k); "
                "reading it back is not supported",
                "merge or re-shard from the original Hugging Face checkpoint",
            )
        if p.scale is not None:  # issue 27
            raise UnsupportedError(
                f"{path} holds {p.source} dequantised from FP8 with {p.scale} (vLLM's load-time "
                "dequantisation of DeepSeek-V3.2's indexer wk); the FP8 bytes cannot be read back",
                "merge or re-shard from the original Hugging Face checkpoint",
            )
        if dtypes.setdefault(p.source, dtype) != dtype:
            raise SourceError(f"{p.source} is stored in two dtypes; cannot read it back")
        regions.setdefault(p.source, []).append(Region(file, pos, p.start, p.stop, p.up, p.pad))
    elif isinstance(p, Cols):  # each part's rows, every `stride` bytes, after the parts before it
        item = ITEMSIZE[dtype]
        widths = [(q.stop[-1] - q.start[-1]) * item for q in p.parts]
        for q, col in zip(p.parts, (sum(widths[:j]) for j in range(len(widths))), strict=True):
            if dtypes.setdefault(q.source, dtype) != dtype:
                raise SourceError(f"{q.source} is stored in two dtypes; cannot read it back")
            region = Region(file, pos + col, q.start, q.stop, None, None, sum(widths))
            regions.setdefault(q.source, []).append(region)
    return pos + p.numel * ITEMSIZE[dtype]


def _tile(name: str, shape: tuple[int, ...], regs: list[Region], sizes: dict) -> list[Region]:
    """Drop replicas so the regions cover the tensor once; check they cover all of it (`sizes`: the
    elements of each extent seen so far, shared by the calls)."""
    seen: dict[tuple, Region] = {}
    for r in regs:
        seen.setdefault((r.start, r.stop, r.up), r)
    unique = list(seen.values())
    if any(r.up for r in unique):
        return unique  # small scale tensors: painted whole, overlaps are copies of one value
    covered = 0
    for r in unique:
        n = sizes.get((r.start, r.stop))  # the same few extents for every expert of a layer
        if n is None:
            n = sizes[(r.start, r.stop)] = math.prod(b - a for a, b in zip(r.start, r.stop, strict=True))
        covered += n
    if covered != math.prod(shape):
        raise SourceError(f"{name}: the output's pieces do not cover it exactly; cannot read it back")
    return unique


def check_complete(path: str, manifest: Manifest) -> None:
    """Refuse what `verify` calls incomplete: a piece's manifest, or a rank of the layout without files."""
    lay = manifest.layout
    have = {f.rank for f in manifest.files}
    missing = [(p, t) for p in range(lay.pp) for t in range(lay.tp) if (p, t) not in have]
    why = (
        "its manifest is a --ranks piece's"
        if manifest.ranks is not None
        else f"its manifest lists no file for pp rank {missing[0][0]}, tp rank {missing[0][1]}"
        if missing
        else None
    )
    if why:
        raise CorruptError(
            f"{path} is not a complete reshard output: {why}",
            "run `reshard verify` on it, or reshard the original checkpoint",
        )


def check_files(path: Path, manifest: Manifest) -> None:
    """Refuse an output as SOURCE unless every file is present, whole and unaltered (rank files and
    copied files, which the checkpoint is read with), and no rank file the manifest does not list
    lies beside them: what `verify` would fail (exit 7)."""

    algorithm = manifest.checksum

    def check(entry: FileRecord) -> str | None:
        try:
            fd = open_regular(path / entry.name, follow=False)  # a symlink or FIFO is refused, not read
        except OSError as e:
            return f"{entry.name}: {e.strerror}"
        try:
            size = os.fstat(fd).st_size
            if size != entry.size:
                return f"{entry.name} has {size} bytes, the manifest says {entry.size}"
            if algorithm == NONE:  # saved with --checksum none: sizes are all there is to check
                return None
            # through the page cache: the tensors are read again right after (O_DIRECT here would
            # leave that second pass cold where the output fits in memory)
            digest = hash_fd(fd, algorithm, limit=entry.size)
        except OSError as e:
            return f"{entry.name}: {e.strerror}"
        finally:
            os.close(fd)
        return None if digest == entry.digest else f"{entry.name} fails its {algorithm} checksum"

    def check_side(side: SideRecord) -> str | None:  # config.json, the tokenizer: read as the checkpoint's
        try:
            fd = open_regular(path / side.name, follow=False)
        except OSError as e:
            return f"{side.name} (copied from the source): {e.strerror}"
        try:
            if os.fstat(fd).st_size != side.size:
                return f"{side.name} (copied from the source) has changed since the save"
            if algorithm != NONE and side.digest is not None and hash_fd(fd, algorithm, limit=side.size) != side.digest:
                return f"{side.name} (copied from the source) has changed since the save"
        except OSError as e:
            return f"{side.name}: {e.strerror}"
        finally:
            os.close(fd)
        return None

    listed = {f.name for f in manifest.files}
    lay = manifest.layout
    stray = [  # what vLLM would load with the ranks' files, and verify fails
        f"{n} is not in the manifest (a rank file of another run?)"
        for n in unlisted_rank_files(os.listdir(path), listed, tp=lay.tp, pp=lay.pp)
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for p in pool.map(check, manifest.files) if p]
        problems += [p for p in pool.map(check_side, manifest.copied_files) if p]
    problems += stray
    if problems:
        raise CorruptError(
            f"{path} cannot be used as SOURCE: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            "run `reshard verify` on it, or reshard the original checkpoint",
        )


_EXACT = {("BF16", "F32"), ("F16", "F32")}


def lossy_tensors(ckpt: Checkpoint) -> list[dict]:
    """Tensors the output holds in a dtype that cannot give back the original values (e.g. a
    bf16 checkpoint saved with --dtype float16, or a float32 one saved as bfloat16)."""
    assert ckpt.manifest is not None and ckpt.manifest.source_tensors is not None
    source = ckpt.manifest.source_tensors
    lossy = [n for n, t in ckpt.tensors.items() if t.dtype != source[n][0] and (source[n][0], t.dtype) not in _EXACT]
    return [
        {"name": n, "original": source[n][0], "stored": ckpt.tensors[n].dtype} for n in sorted(lossy, key=natural_key)
    ]


def check_lossless_reshard(ckpt: Checkpoint, dtype: str) -> None:
    """Re-sharding an output into another dtype than it holds gives the bytes of re-sharding the
    original only where the output holds the original's values: one saved narrower (bf16 as
    --dtype float16) cast again would be refused as lossy by `merge`, so it is refused here too."""
    if ckpt.manifest is None or ckpt.manifest.source_tensors is None or dtype in ("auto", ckpt.manifest.layout.dtype):
        return
    lossy = lossy_tensors(ckpt)
    if lossy:
        first = lossy[0]
        raise UnsupportedError(
            f"this output holds {len(lossy)} tensor(s) in a dtype that lost precision against the original (e.g. "
            f"{first['name']}: {first['original']} saved as {first['stored']}): re-sharding it as --dtype {dtype} "
            "cannot give the values of re-sharding the original",
            "re-shard the original checkpoint, or keep --dtype auto: the output's own dtype",
        )
