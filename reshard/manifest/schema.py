"""The manifest's schema: typed records, parsed (and validated) from `reshard.json` and written back,
here and nowhere else. Everything outside reshard.manifest reads a `Manifest`'s attributes, never its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard import VLLM_LAYOUT, VLLM_VERSIONS
from reshard.format import DTYPE_CODES
from reshard.hashing import ALGORITHMS, FIELD, LEGACY, NONE
from reshard.layout import Layout
from reshard.names import file_pattern, parse_rank_file

FORMAT = "reshard-sharded-state"
FORMAT_VERSION = 1


class ManifestProblem(ValueError):
    """What makes a manifest unusable, as a phrase (`layout.tp is 0`)."""


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
            "layout": {
                "vllm_layout": self.vllm_layout,
                "architecture": self.architecture,
                "tp": lay.tp,
                "pp": lay.pp,
                "ep": lay.ep,
                "dtype": lay.dtype,
                "quantization": lay.quantization,
                "pattern": file_pattern(lay.pp),
                "pp_layer_partition": list(lay.partition or ()),
                "moe_backend": lay.moe_backend,
                "moe_backend_pinned": lay.moe_pin,
            },
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
          "serve_reshard", "notes", "ranks", "all_files", "source_files"}  # fmt: skip


def parse(obj: object) -> Manifest:
    """The typed manifest of a parsed `reshard.json` (or piece manifest). Raises ManifestProblem."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ManifestProblem("not a reshard manifest")
    if obj.get("format_version") != FORMAT_VERSION:
        raise ManifestProblem(f"format version {obj.get('format_version')!r} is not {FORMAT_VERSION}")
    for key in ("layout", "files", "run_id", "source"):
        if key not in obj:
            raise ManifestProblem(f"no {key!r}")
    algorithm = obj.get(FIELD, LEGACY)
    if algorithm not in ALGORITHMS:
        raise ManifestProblem(f"checksum {algorithm!r} is not one of {', '.join(ALGORITHMS)} (a newer reshard?)")
    _need(isinstance(obj["run_id"], str), "run_id is not a string")
    _need(isinstance(obj["source"], dict), "source is not an object")
    architecture, layout, vllm_layout = _layout(obj["layout"])
    spec = obj.get("vllm_versions")
    _need(spec is None or isinstance(spec, str), f"vllm_versions is {spec!r}")
    if spec is None:
        spec = VLLM_VERSIONS if vllm_layout == VLLM_LAYOUT else None
    files = _list(obj["files"], "files")
    seen: set[str] = set()
    records = tuple(_file(i, e, seen, algorithm) for i, e in enumerate(files))
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
        total_bytes=_int(obj.get("total_bytes", sum(f.size for f in records)), "total_bytes"),
        copied=tuple(_strings(obj.get("copied") or [], "copied")),
        copied_files=tuple(
            _side(i, e, algorithm) for i, e in enumerate(_list(obj.get("copied_files") or [], "copied_files"))
        ),
        source_tensors=_source_tensors(obj.get("source_tensors")),
        serve=str(obj.get("serve") or ""),
        serve_reshard=obj.get("serve_reshard") if isinstance(obj.get("serve_reshard"), str) else None,
        notes=tuple(_strings(obj.get("notes") or [], "notes")),
        ranks=tuple(_int(r, "ranks") for r in _list(obj["ranks"], "ranks")) if "ranks" in obj else None,
        all_files=tuple(_strings(obj.get("all_files") or [], "all_files")) if "ranks" in obj else None,
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
        source_files=_source_files(obj["source_files"]) if "source_files" in obj else None,
    )


def _layout(lay: object) -> tuple[str, Layout, str]:
    _need(isinstance(lay, dict), "layout is not an object")
    assert isinstance(lay, dict)
    for k in ("tp", "pp"):
        _need(type(lay.get(k)) is int and lay[k] >= 1, f"layout.{k} is {lay.get(k)!r}")
    _need(isinstance(lay.get("ep"), bool), f"layout.ep is {lay.get('ep')!r}")
    part = lay.get("pp_layer_partition")
    _need(
        part is None or (isinstance(part, list) and all(type(x) is int and x >= 1 for x in part)),
        f"layout.pp_layer_partition is {part!r}",
    )
    dtype = lay.get("dtype") or "auto"
    dtype = DTYPE_CODES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    quant = lay.get("quantization")
    _need(quant is None or isinstance(quant, dict), f"layout.quantization is {quant!r}")
    backend, pin = lay.get("moe_backend") or "auto", lay.get("moe_backend_pinned")
    _need(isinstance(backend, str) and (pin is None or isinstance(pin, str)), f"layout.moe_backend is {backend!r}")
    try:
        layout = Layout(lay["tp"], lay["pp"], lay["ep"], dtype, tuple(part) if part else None, backend, pin, quant)
    except ValueError as e:
        raise ManifestProblem(f"layout: {e}") from None
    arch = lay.get("architecture")
    return (arch if isinstance(arch, str) else ""), layout, str(lay.get("vllm_layout") or "")


def _file(i: int, e: object, seen: set[str], algorithm: str) -> FileRecord:
    _need(isinstance(e, dict), f"files[{i}] is not an object")
    assert isinstance(e, dict)
    name = e.get("name")
    _need(
        isinstance(name, str) and parse_rank_file(name) is not None, f"files[{i}].name {name!r} is not a rank file name"
    )
    _need(name not in seen, f"{name} is listed twice")
    seen.add(name)
    for k in ("tp_rank", "pp_rank", "part", "size"):
        _need(type(e.get(k)) is int and e[k] >= 0, f"files[{i}].{k} is {e.get(k)!r}")
    digest = e.get(algorithm) if algorithm != NONE else None
    _need(algorithm == NONE or isinstance(digest, str), f"files[{i}].{algorithm} is {e.get(algorithm)!r}")
    ts = e.get("tensors")
    ok = isinstance(ts, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list)
        and all(type(n) is int for n in t["shape"])
        for t in ts
    )
    _need(ok, f"files[{i}].tensors is malformed")
    tensors = tuple(TensorRecord(t["name"], t["dtype"], tuple(t["shape"])) for t in ts)  # type: ignore[union-attr]
    return FileRecord(name, e["tp_rank"], e["pp_rank"], e["part"], e["size"], digest, tensors)  # type: ignore[arg-type]


def _side(i: int, e: object, algorithm: str) -> SideRecord:
    ok = isinstance(e, dict) and isinstance(e.get("name"), str) and type(e.get("size")) is int
    digest = e.get(algorithm) if ok and algorithm != NONE else None  # type: ignore[union-attr]
    _need(ok and (algorithm == NONE or isinstance(digest, str)), f"copied_files[{i}] is malformed ({e!r})")
    return SideRecord(e["name"], e["size"], digest)  # type: ignore[index]


def _source_tensors(src: object) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    if src is None:
        return None
    _need(isinstance(src, dict), "source_tensors is not an object")
    out = {}
    for name, v in src.items():  # type: ignore[union-attr]
        ok = isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list)
        _need(ok and all(type(n) is int and n >= 0 for n in v[1]), f"source_tensors[{name!r}] is {v!r}")
        out[name] = (v[0], tuple(v[1]))
    return out


def _source_files(v: object) -> tuple[SourceFileRecord, ...]:
    out = []
    for i, e in enumerate(_list(v, "source_files")):
        ok = isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("check"), str)
        ok = ok and type(e.get("size")) is int and (e.get("sha256") is None or isinstance(e.get("sha256"), str))
        _need(ok, f"source_files[{i}] is malformed")
        out.append(SourceFileRecord(e["name"], e["size"], e.get("sha256"), e["check"]))  # type: ignore[index,union-attr]
    return tuple(out)


def _need(ok: bool, problem: str) -> None:
    if not ok:
        raise ManifestProblem(problem)


def _list(v: object, what: str) -> list:
    _need(isinstance(v, list), f"{what} is not a list")
    return v  # type: ignore[return-value]


def _strings(v: object, what: str) -> list[str]:
    _need(isinstance(v, list) and all(isinstance(s, str) for s in v), f"{what} is not a list of names")
    return v  # type: ignore[return-value]


def _int(v: object, what: str) -> int:
    _need(type(v) is int and v >= 0, f"{what} is {v!r}")
    return v  # type: ignore[return-value]
