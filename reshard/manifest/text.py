"""The manifest's text, written in bulk (issue 28): one string per tensor, not a dict each and
json's pure-Python indenting encoder over them.

`json.dumps(obj, indent=1)` (what `reshard.json` has always been) runs in Python once indented; for the
200k source tensors and every rank's tensors of a large MoE that was seconds and a dict per tensor.
Here the manifest's small parts go through that same call, and each tensor entry (`{"name", "dtype",
"shape"}` of a rank file, `name: [dtype, shape]` of the source) is formatted directly, its strings
escaped by json's own C escaper: byte for byte the same text (tests/test_manifest_bytes.py compares
it with the old builder's). An indented subtree at depth d is the top-level text with every line
break followed by d more spaces: strings never hold a raw line break (JSON escapes it).
"""

from __future__ import annotations

import dataclasses
import json
from json.encoder import encode_basestring_ascii as _string  # what json.dumps uses (C), ensure_ascii

from reshard.manifest.schema import Manifest


def manifest_text(manifest: Manifest) -> str:
    """`json.dumps(manifest.to_json(), indent=1)`, the tensors formatted in bulk."""
    bare = dataclasses.replace(
        manifest,
        files=tuple(dataclasses.replace(f, tensors=()) for f in manifest.files),
        source_tensors={} if manifest.source_tensors is not None else None,
    )
    obj = bare.to_json()
    parts = []
    for key, value in obj.items():
        if key == "files":
            text = _files(value, manifest)
        elif key == "source_tensors" and manifest.source_tensors:
            text = _source_tensors(manifest.source_tensors)
        else:
            text = _nested(value, 1)
        parts.append(f" {_string(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}" if parts else "{}"


def _nested(value: object, depth: int) -> str:
    return json.dumps(value, indent=1).replace("\n", "\n" + " " * depth)


def _files(entries: list[dict], manifest: Manifest) -> str:
    """The `files` list (depth 1): each file's own keys as json writes them, its tensors in bulk."""
    if not entries:
        return "[]"
    out = []
    for entry, f in zip(entries, manifest.files, strict=True):
        keys = []
        for key, value in entry.items():
            text = _tensors(f.tensors) if key == "tensors" else _nested(value, 3)
            keys.append(f"   {_string(key)}: {text}")
        out.append("  {\n" + ",\n".join(keys) + "\n  }")
    return "[\n" + ",\n".join(out) + "\n ]"


def _shape(shape: tuple[int, ...], depth: int, cache: dict) -> str:
    """A shape list whose items sit at `depth` (its brackets one less), as json indents it."""
    text = cache.get(shape)
    if text is None:
        if not shape:
            text = "[]"
        else:
            sep = "\n" + " " * depth
            text = "[" + sep + ("," + sep).join(map(int.__repr__, shape)) + "\n" + " " * (depth - 1) + "]"
        cache[shape] = text
    return text


def _tensors(tensors) -> str:
    """A rank file's tensors (the list at depth 3: entries at 4, their keys at 5, shape items at 6)."""
    if not tensors:
        return "[]"
    cache: dict = {}
    dtypes: dict = {}
    lines = []
    for t in tensors:
        dtype = dtypes.get(t.dtype) or dtypes.setdefault(t.dtype, _string(t.dtype))
        lines.append(
            '    {\n     "name": ' + _string(t.name) + ',\n     "dtype": ' + dtype
            + ',\n     "shape": ' + _shape(tuple(t.shape), 6, cache) + "\n    }"
        )  # fmt: skip
    return "[\n" + ",\n".join(lines) + "\n   ]"


def _source_tensors(src: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    """name -> [dtype, shape] (the object at depth 1: names at 2, [dtype, shape] items at 3)."""
    cache: dict = {}
    dtypes: dict = {}
    lines = []
    for name, (dtype, shape) in src.items():
        d = dtypes.get(dtype) or dtypes.setdefault(dtype, _string(dtype))
        lines.append("  " + _string(name) + ": [\n   " + d + ",\n   " + _shape(tuple(shape), 4, cache) + "\n  ]")
    return "{\n" + ",\n".join(lines) + "\n }"
