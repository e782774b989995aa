"""The manifest's schema: typed records, parsed (and validated) from `reshard.json` and written back,
here and nowhere else. Everything outside reshard.manifest reads a `Manifest`'s attributes, never its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from pathlib import PurePosixPath

from reshard import VLLM_LAYOUT, VLLM_VERSIONS
from reshard.format import ITEMSIZE
from reshard.hashing import ALGORITHMS, FIELD, LEGACY, NONE
from reshard.layout import Layout
from reshard.manifest.layoutjson import layout_json, parse_layout
from reshard.manifest.validate import (
    MAX_DIMS,
    MAX_FILES,
    MAX_PART,
    MAX_PP,
    MAX_SIZE,
    MAX_TENSORS,
    MAX_TP,
    ManifestProblem,
    as_int,
    as_list,
    need,
    optional,
    strings,
)
from reshard.names import CONFIG, parse_rank_file

FORMAT = "reshard-sharded-state"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class TensorRecord:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A rank file the run wrote: its ranks, size, digest (None: checksum none) and tensors."""

    name: str
    tp_rank: int
    pp_rank: int
    part: int
    size: int
    digest: str | None
    tensors: tuple[TensorRecord, ...]

    @property
    def rank(self) -> tuple[int, int]:
        return (self.pp_rank, self.tp_rank)


@dataclass(frozen=True, slots=True)
class SideRecord:
    """A file reshard copied (config, tokenizer, ...), path relative to the output folder."""

    name: str
    size: int
    digest: str | None


@dataclass(frozen=True, slots=True)
class SourceFileRecord:
    """A source safetensors file: its sha256 (None when unchecked) and how it was checked
    (reshard.sources.integrity's CHECKS: "hub-lfs-sha256 verified", "unchecked", ...)."""

    name: str
    size: int
    sha256: str | None
    check: str


@dataclass(frozen=True)
class Manifest:
    """What a run wrote (`reshard.json`), or a `save --ranks` piece's part of it (`ranks` set).

    checksum: the algorithm of every digest (reshard.hashing.ALGORITHMS; sha256 when the field is absent).
    source: where it came from ({"path"} or {"repo_id", "revision", "commit"}; re-shards add
        "resharded_from" and "from_run").
    vllm_versions: the vLLM releases that load the layout (for manifests written before the range
        was recorded: this reshard's range when their vllm_layout is ours, else None).
    source_tensors: the source's headers (name -> (dtype, shape)): with the copied config.json,
        enough to plan the layout again without the source. None in manifests of older releases.
    """

    run_id: str
    source: dict
    architecture: str
    layout: Layout
    files: tuple[FileRecord, ...]
    checksum: str = LEGACY
    reshard_version: str = ""
    created: str = ""
    vllm_layout: str = VLLM_LAYOUT
    vllm_versions: str | None = VLLM_VERSIONS
    total_bytes: int = 0
    copied: tuple[str, ...] = ()
    copied_files: tuple[SideRecord, ...] = ()
    source_tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None
    serve: str = ""
    serve_reshard: str | None = None
    notes: tuple[str, ...] = ()
    ranks: tuple[int, ...] | None = None  # a piece's engine ranks
    all_files: tuple[str, ...] | None = None  # a piece: every file of the whole job
    extra: dict = field(default_factory=dict)  # keys of a newer reshard, kept when rewritten
    source_files: tuple[SourceFileRecord, ...] | None = None  # None in manifests of older releases
    # an s3:// output: each object's SHA256 as the store reports it (HEAD, ChecksumMode=ENABLED), by file
    # name: "<base64>-<parts>" for a multipart object. `verify s3://` compares it without reading the object.
    store_sha256: dict[str, str] | None = None

    @property
    def origin(self) -> dict:
        """The original source: the one a re-shard was made from, else `source`."""
        before = self.source.get("resharded_from")
        return before if isinstance(before, dict) else self.source

    def rank_files(self, pp_rank: int, tp_rank: int) -> list[FileRecord]:
        """The files of one engine rank, by part."""
        return sorted((f for f in self.files if f.rank == (pp_rank, tp_rank)), key=lambda f: f.part)

    def to_json(self) -> dict:
        lay = self.layout
        out: dict = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "reshard_version": self.reshard_version,
            FIELD: self.checksum,
            "run_id": self.run_id,
            "created": self.created,
            "source": self.source,
            "layout": layout_json(lay, self.architecture, self.vllm_layout),
            "vllm_versions": self.vllm_versions,
            "total_bytes": self.total_bytes,
            "files": [_file_json(f, self.checksum) for f in self.files],
            "copied": list(self.copied),
            "copied_files": [
                _digest({"name": s.name, "size": s.size}, self.checksum, s.digest) for s in self.copied_files
            ],
            "source_tensors": _tensors_json(self.source_tensors),
            "serve": self.serve,
            "serve_reshard": self.serve_reshard,
            "notes": list(self.notes),
        }
        if self.source_files is not None:
            out["source_files"] = [
                {"name": f.name, "size": f.size, "sha256": f.sha256, "check": f.check} for f in self.source_files
            ]
        if self.store_sha256 is not None:
            out["store_sha256"] = dict(self.store_sha256)
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
            out["all_files"] = list(self.all_files or ())
        return {**self.extra, **out}


def _digest(entry: dict, algorithm: str, digest: str | None) -> dict:
    if algorithm != NONE and digest is not None:
        entry[algorithm] = digest
    return entry


def _tensors_json(src: dict[str, tuple[str, tuple[int, ...]]] | None) -> dict | None:
    return None if src is None else {n: [d, list(s)] for n, (d, s) in src.items()}


def _file_json(f: FileRecord, algorithm: str) -> dict:
    entry = {"name": f.name, "tp_rank": f.tp_rank, "pp_rank": f.pp_rank, "part": f.part, "size": f.size}
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in f.tensors]
    return _digest({**entry, "tensors": tensors}, algorithm, f.digest)


# ---- parsing ----------------------------------------------------------------------------------------

_KNOWN = {"format", "format_version", "reshard_version", FIELD, "run_id", "created", "source", "layout",
          "vllm_versions", "total_bytes", "files", "copied", "copied_files", "source_tensors", "serve",
          "serve_reshard", "notes", "ranks", "all_files", "source_files", "store_sha256"}  # fmt: skip


def parse(obj: object) -> Manifest:
    """The typed manifest of a parsed `reshard.json` (or piece manifest). Raises ManifestProblem."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ManifestProblem("not a reshard manifest")
    version = obj.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # True == 1 in Python
        raise ManifestProblem(f"format version {obj.get('format_version')!r} is not {FORMAT_VERSION}")
    for key in ("layout", "files", "run_id", "source"):
        if key not in obj:
            raise ManifestProblem(f"no {key!r}")
    algorithm = obj.get(FIELD, LEGACY)
    if algorithm not in ALGORITHMS:
        raise ManifestProblem(f"checksum {algorithm!r} is not one of {', '.join(ALGORITHMS)} (a newer reshard?)")
    need(isinstance(obj["run_id"], str), "run_id is not a string")
    need(isinstance(obj["source"], dict), "source is not an object")
    architecture, layout, vllm_layout = parse_layout(obj["layout"])
    spec = obj.get("vllm_versions")
    need(spec is None or isinstance(spec, str), f"vllm_versions is {spec!r}")
    if spec is None:
        spec = VLLM_VERSIONS if vllm_layout == VLLM_LAYOUT else None
    files = as_list(obj["files"], "files", MAX_FILES)
    seen: set[str] = set()
    records = tuple(_file(i, e, seen, algorithm) for i, e in enumerate(files))
    need(sum(len(f.tensors) for f in records) <= MAX_TENSORS, f"more than {MAX_TENSORS} tensors")
    sides = as_list(optional(obj, "copied_files"), "copied_files")
    # save copies config.json always: a manifest that leaves it out would let an edited one through unchecked
    need(
        obj.get("copied_files") is None or any(isinstance(e, dict) and e.get("name") == CONFIG for e in sides),
        f"copied_files does not list {CONFIG} (every reshard output records the one it was saved with)",
    )
    world = layout.tp * layout.pp
    ranks = None
    if "ranks" in obj:
        ranks = tuple(as_int(r, "ranks", world - 1) for r in as_list(obj["ranks"], "ranks", world))
    return Manifest(
        run_id=obj["run_id"],
        source=obj["source"],
        architecture=architecture,
        layout=layout,
        files=records,
        checksum=algorithm,
        reshard_version=str(obj.get("reshard_version", "")),
        created=str(obj.get("created", "")),
        vllm_layout=vllm_layout,
        vllm_versions=spec,
        total_bytes=as_int(obj.get("total_bytes", sum(f.size for f in records)), "total_bytes", MAX_SIZE),
        copied=tuple(_inside(n, "copied") for n in strings(optional(obj, "copied"), "copied")),
        copied_files=tuple(_side(i, e, algorithm) for i, e in enumerate(sides)),
        source_tensors=_source_tensors(obj.get("source_tensors")),
        serve=str(obj.get("serve") or ""),
        serve_reshard=obj.get("serve_reshard") if isinstance(obj.get("serve_reshard"), str) else None,
        notes=tuple(strings(obj.get("notes") or [], "notes")),
        ranks=ranks,
        all_files=tuple(strings(obj.get("all_files") or [], "all_files")) if "ranks" in obj else None,
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
        source_files=_source_files(obj["source_files"]) if "source_files" in obj else None,
        store_sha256=_store_sums(obj["store_sha256"]) if obj.get("store_sha256") is not None else None,
    )


def _file(i: int, e: object, seen: set[str], algorithm: str) -> FileRecord:
    need(isinstance(e, dict), f"files[{i}] is not an object")
    assert isinstance(e, dict)
    name = e.get("name")
    need(
        isinstance(name, str) and parse_rank_file(name) is not None and "/" not in name and "\n" not in name,
        f"files[{i}].name {name!r} is not a rank file name",
    )
    need(name not in seen, f"{name} is listed twice")
    seen.add(name)
    for k, most in (("tp_rank", MAX_TP), ("pp_rank", MAX_PP), ("part", MAX_PART), ("size", MAX_SIZE)):
        need(type(e.get(k)) is int and 0 <= e[k] <= most, f"files[{i}].{k} is {e.get(k)!r}")
    digest = e.get(algorithm) if algorithm != NONE else None
    need(algorithm == NONE or isinstance(digest, str), f"files[{i}].{algorithm} is {e.get(algorithm)!r}")
    _no_digest_under_none(e, algorithm, f"files[{i}]")
    ts = e.get("tensors")
    ok = isinstance(ts, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list)
        and len(t["shape"]) <= MAX_DIMS
        and all(type(n) is int and 0 <= n <= MAX_SIZE for n in t["shape"])
        for t in ts
    )
    need(ok, f"files[{i}].tensors is malformed")
    tensors = tuple(TensorRecord(t["name"], t["dtype"], tuple(t["shape"])) for t in ts)  # type: ignore[union-attr]
    return FileRecord(name, e["tp_rank"], e["pp_rank"], e["part"], e["size"], digest, tensors)  # type: ignore[arg-type]


def _side(i: int, e: object, algorithm: str) -> SideRecord:
    ok = isinstance(e, dict) and isinstance(e.get("name"), str) and type(e.get("size")) is int
    ok = ok and 0 <= e["size"] <= MAX_SIZE  # type: ignore[index]
    digest = e.get(algorithm) if ok and algorithm != NONE else None  # type: ignore[union-attr]
    need(ok and (algorithm == NONE or isinstance(digest, str)), f"copied_files[{i}] is malformed ({str(e)[:200]})")
    _no_digest_under_none(e, algorithm, f"copied_files[{i}]")  # type: ignore[arg-type]
    return SideRecord(_inside(e["name"], f"copied_files[{i}].name"), e["size"], digest)  # type: ignore[index]


def _no_digest_under_none(e: dict, algorithm: str, what: str) -> None:
    """A manifest saying `checksum: none` holds no digest: one that does was edited to skip the checks."""
    held = [a for a in ALGORITHMS if a != NONE and a in e]
    need(algorithm != NONE or not held, f"{what} holds a {held[0] if held else ''} digest, but checksum is none")


def _inside(name: str, what: str) -> str:
    """A copied file's name: relative, inside the folder (no leading `/`, no `..`, no NUL)."""
    path = PurePosixPath(name)
    ok = bool(name) and not path.is_absolute() and ".." not in path.parts and "\0" not in name and "\\" not in name
    need(ok, f"{what} {name[:200]!r} is not a name inside the folder")
    return name


def _source_tensors(src: object) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    if src is None:
        return None
    need(isinstance(src, dict) and len(src) <= MAX_FILES, "source_tensors is not an object of tensors")
    assert isinstance(src, dict)
    if _well_formed(list(src.values())):  # one entry per source tensor: 200k at Kimi-K2's scale
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape
        return {name: (v[0], shapes.setdefault(t := tuple(v[1]), t)) for name, v in src.items()}
    out = {}
    for name, v in src.items():  # the slow way, to name the entry that is wrong
        ok = isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0] in ITEMSIZE
        ok = ok and isinstance(v[1], list) and len(v[1]) <= MAX_DIMS
        ok = ok and all(type(n) is int and 0 <= n <= MAX_SIZE for n in v[1])
        need(ok, f"source_tensors[{name[:200]!r}] is {str(v)[:200]}")
        out[name] = (v[0], tuple(v[1]))
    return out


def _well_formed(values: list) -> bool:
    """Whether every value is [dtype, shape] with a known dtype and a shape of at most MAX_DIMS sizes
    in [0, MAX_SIZE]: the per-entry checks of `_source_tensors`, as a few C-level passes over all."""
    if not values:
        return True
    try:
        if set(map(type, values)) != {list} or set(map(len, values)) != {2}:
            return False
        dtypes = set(map(itemgetter(0), values))
        if set(map(type, dtypes)) != {str} or not dtypes <= ITEMSIZE.keys():
            return False
        shapes = list(map(itemgetter(1), values))
        if set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_DIMS:
            return False
        dims = list(chain.from_iterable(shapes))
        return not dims or (set(map(type, dims)) == {int} and min(dims) >= 0 and max(dims) <= MAX_SIZE)
    except TypeError:  # an unhashable dtype
        return False


def _source_files(v: object) -> tuple[SourceFileRecord, ...]:
    out = []
    for i, e in enumerate(as_list(v, "source_files")):
        ok = isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("check"), str)
        ok = ok and type(e.get("size")) is int and (e.get("sha256") is None or isinstance(e.get("sha256"), str))
        need(ok, f"source_files[{i}] is malformed")
        out.append(SourceFileRecord(e["name"], e["size"], e.get("sha256"), e["check"]))  # type: ignore[index,union-attr]
    return tuple(out)


def _store_sums(v: object) -> dict[str, str]:
    ok = isinstance(v, dict) and len(v) <= MAX_FILES
    ok = ok and all(isinstance(k, str) and isinstance(x, str) and len(x) < 200 for k, x in v.items())  # type: ignore[union-attr]
    need(ok, "store_sha256 is not an object of names and checksums")
    return dict(v)  # type: ignore[arg-type]
