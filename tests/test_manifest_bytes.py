"""The manifest's text built in bulk (reshard.manifest.text, issue 28) is byte for byte what the old
builder wrote: `json.dumps(manifest.to_json(), indent=1)` and a line break, for manifests of real saves
and for hand-made ones holding every kind of value a manifest can."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reshard.layout import Layout
from reshard.manifest import FileRecord, Manifest, SideRecord, TensorRecord, manifest_bytes, read_manifest
from reshard.manifest.schema import SourceFileRecord
from tests.fixtures.saving import save


def old_manifest_bytes(manifest: Manifest) -> bytes:
    return (json.dumps(manifest.to_json(), indent=1) + "\n").encode()


@pytest.mark.parametrize(
    "arch, layout",
    [("llama", {"tp": 2}), ("qwen3-moe", {"tp": 2, "ep": True}), ("deepseek-v3-fp8", {"tp": 2, "pp": 2})],
)
def test_saved_manifests_are_the_old_bytes(tiny, tmp_path, arch, layout):
    from reshard.plan import DEFAULT_MAX_PART

    out = tmp_path / "out"
    save(str(tiny(arch)), out, max_part_size=DEFAULT_MAX_PART, **layout)
    raw = (out / "reshard.json").read_bytes()
    m = read_manifest(out)
    assert manifest_bytes(m) == old_manifest_bytes(m) == raw


def tensors(*specs) -> tuple[TensorRecord, ...]:
    return tuple(TensorRecord(n, d, s) for n, d, s in specs)


ODD = tensors(
    ("model.layers.0.w", "BF16", (4, 8)),
    ("scalar", "F32", ()),
    ('quote"and\\back\nslash\ttab', "I8", (1,)),
    ("ünïcødé 名前 \u2028 \x00", "F8_E4M3", (3, 1, 2)),
    ("big", "U8", (2**40, 0)),
)


def manifest(**changes) -> Manifest:
    base = Manifest(
        run_id="0" * 32,
        source={"path": "/src/ü", "nested": {"a": [1, 2.5, None, True]}},
        architecture="LlamaForCausalLM",
        layout=Layout(tp=2),
        files=(
            FileRecord("model-rank-0-part-0.safetensors", 0, 0, 0, 10, "ab" * 32, ODD),
            FileRecord("model-rank-1-part-0.safetensors", 1, 0, 0, 0, "cd" * 32, ()),
        ),
        checksum="blake3",
        reshard_version="0.1.0",
        created="2026-12-03T00:00:00+00:00",
        total_bytes=10,
        copied=("config.json",),
        copied_files=(SideRecord("config.json", 3, "ef" * 32),),
        source_tensors={t.name: (t.dtype, t.shape) for t in ODD},
        serve="vllm serve x",
        serve_reshard="vllm serve x --load-format reshard",
        notes=("a note", 'with "quotes"'),
    )
    return dataclasses.replace(base, **changes)


CASES = {
    "plain": {},
    "no source tensors": {"source_tensors": None},
    "empty source tensors": {"source_tensors": {}},
    "no files": {"files": ()},
    "checksum none": {"checksum": "none", "files": (FileRecord("model-rank-0-part-0.safetensors", 0, 0, 0, 1, None, ODD),)},
    "a piece": {"ranks": (0,), "all_files": ("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors")},
    "source files": {"source_files": (SourceFileRecord("m.safetensors", 5, None, "unchecked"),)},
    "store sums": {"store_sha256": {"model-rank-0-part-0.safetensors": "x==-2"}},
    "newer keys": {"extra": {"zz_future": {"k": [1, {"deep": []}]}, "aa_first": "v"}},
    "no notes": {"notes": ()},
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_hand_made_manifests_are_the_old_bytes(case):
    m = manifest(**CASES[case])
    assert manifest_bytes(m) == old_manifest_bytes(m)
