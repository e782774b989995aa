"""Tensors copied whole to every rank (norms, routers, embeddings of the towers) are checked against the
shape vLLM builds from config.json before anything is written: a source tensor of another shape would be
copied as it is, and verify would pass it.

Two halves: every table declares the shape of every whole-copied tensor (so a new family cannot forget),
and, in every tiny family, each declared tensor narrowed by one row (or given an extra dimension, where
config.json does not give its sizes) is refused with exit 4's SourceError naming it.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.errors import SourceError
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.rules import ARCHITECTURES, BY_PLATFORM, BY_PREFIX, Architecture, Replicate
from reshard.sources import open_source

# whole-copied tensors whose shape config.json does not give: (table path, why)
UNDECLARED = {
    # ReplicatedLinear [hidden * merge_h * merge_w, ...]: sizes vLLM derives, no config key holds them
    "mm_projector.linear_1": "Kimi-K2.5's projector: its width is vision hidden x merge_kernel_size",
    "mm_projector.linear_2": "Kimi-K2.5's projector: its width is vision hidden x merge_kernel_size",
    # ReplicatedLinear(hidden, 1) built with the quant config: checked as a linear by its dims elsewhere
    "indexer.wq_b": "declared by dims (q_lora_rank columns)",
}


def _tables() -> list[Architecture]:
    tables = {id(a): a for a in ARCHITECTURES.values()}
    for by in BY_PLATFORM.values():
        tables.update({id(a): a for a in by.values() if isinstance(a, Architecture)})
    tables.update({id(a): a for _, a in BY_PREFIX.values()})
    return list(tables.values())


def _replicated(arch: Architecture) -> list[tuple[Replicate, dict | None]]:
    """Every Replicate of the table, with its tower (None: the language model)."""
    rules = [*arch.top, *arch.layer, *arch.dense_mlp, *arch.moe_mlp]
    if arch.mixers:
        rules += [r for group in arch.mixers.by_type.values() for r in group]
    found = [(r, None) for r in rules if isinstance(r, Replicate)]
    for tower in arch.towers:
        for r in [*tower.top, *(r for b in tower.blocks for r in b.rules)]:
            if isinstance(r, Replicate):
                found.append((r, tower))
    return found


def test_every_whole_copied_tensor_declares_its_shape():
    missing = set()
    for arch in _tables():
        for r, _ in _replicated(arch):
            declared = r.shape if not r.quant else tuple(d for d in r.dims if d)
            if not declared and not any(r.name.endswith(k) for k in UNDECLARED):
                missing.add(f"{arch.names[0]}: {r.name}.{r.param}")
    assert not missing, "declare Replicate.shape (or a quantizable one's dims): " + ", ".join(sorted(missing))


def test_the_structural_check_sees_towers_and_mixers():
    names = {r.name for a in _tables() for r, _ in _replicated(a)}
    assert {"visual.merger.ln_q", "linear_attn.norm", "norm1", "model.norm"} <= names
    assert "shape" in {f.name for f in fields(Replicate)}


# ---- each declared tensor of each tiny family, narrowed ---------------------------------------------

FAMILIES = [
    "llama",
    "qwen3",
    "qwen2-moe",
    "qwen3-moe",
    "mixtral",
    "deepseek-v3",
    "deepseek-v2-lite",
    "deepseek-v32",
    "glm4.7-flash",
    "gemma2",
    "gemma3",
    "gemma3-mm",
    "glm4-moe",
    "gpt-oss",
    "kimi-k2",
    "kimi-k2.5",
    "llama4",
    "minimax-m2",
    "qwen3-next",
    "qwen3.5-moe",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
]


def _read(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, where = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[k] = h.get_tensor(k)
                where[k] = f.name
    return tensors, where


def _declared(src: Path) -> list[tuple[str, tuple[int | None, ...]]]:
    """(source tensor, the sizes config.json gives per dimension) of every declared whole-copied tensor a
    plan of `src` reads (its towers too, where its table has them)."""
    from reshard.rules import for_checkpoint, get_architecture

    config = json.loads((src / "config.json").read_text())
    names = set(open_source(str(src)).checkpoint.tensors)
    name, arch = get_architecture(config)
    arch = for_checkpoint(name, arch, names)
    out = []
    for r, tower in _replicated(arch):
        settings = tower.settings(config) if tower else arch.text(config)
        keys = r.shape if not r.quant else r.dims
        if not keys or not r.present(settings):
            continue
        sizes = tuple(k if isinstance(k, int) else _int(settings.get(_key(arch, settings, k))) for k in keys)
        ends = {f"{r.hf}.{r.param}", *arch.hf_names(f"{r.name}.{r.param}")}  # the export's own spellings too
        match = [n for n in sorted(names) if any(n == e or n.endswith("." + e) for e in ends)]
        if match and match[0] not in dict(out):
            out.append((match[0], sizes))
    return out


def _key(arch: Architecture, settings: dict, key: str | None) -> str | None:
    """The expert count under whichever of the table's keys config.json spells it."""
    if key in arch.experts_key:
        return next((k for k in arch.experts_key if settings.get(k)), key)
    return key


def _layout(src: Path) -> Layout:
    """TP 1, with the encoder written where the family has a tower table."""
    from reshard.rules import get_architecture

    _, arch = get_architecture(json.loads((src / "config.json").read_text()))
    return Layout(tp=1, mm_encoder_tp_mode="weights" if arch.towers else None)


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _narrowed(t: torch.Tensor, sizes: tuple[int | None, ...]) -> torch.Tensor:
    """One row fewer along the first dimension config.json sizes; else one dimension more."""
    for d, s in enumerate(sizes):
        if s is not None and s > 1 and d < t.dim():
            return t.narrow(d, 0, s - 1).contiguous()
    return t.unsqueeze(0).contiguous()


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_shapes_refuse_a_narrowed_tensor(tiny, tmp_path, family):
    src = tiny(family)
    build_plan(open_source(str(src)).checkpoint, _layout(src))  # the family's own checkpoint plans
    declared = _declared(src)
    assert declared, f"{family}: no declared whole-copied tensor found"
    tensors, where = _read(src)
    for name, sizes in declared:
        bad = tmp_path / name
        bad.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                (bad / f.name).symlink_to(f)
        changed = {**tensors, name: _narrowed(tensors[name], sizes)}
        for file in set(where.values()):
            save_file({k: v for k, v in changed.items() if where[k] == file}, str(bad / file), {"format": "pt"})
        with pytest.raises(SourceError, match="has shape") as e:
            build_plan(open_source(str(bad)).checkpoint, _layout(src))
        assert name in str(e.value), (family, name, str(e.value))


# ---- the CLI's view: exit 4, one line, nothing written -----------------------------------------------


def _replaced(src: Path, out: Path, name: str, value: torch.Tensor) -> Path:
    """A copy of the one-file checkpoint `src` with tensor `name` replaced."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).symlink_to(f)
    tensors, _ = _read(src)
    save_file({**tensors, name: value}, str(out / "model.safetensors"), {"format": "pt"})
    return out


@pytest.mark.parametrize(
    "name, value, says",
    [
        # a norm of half the width: copied whole before, and verify passed it
        ("model.norm.weight", torch.ones(32, dtype=torch.bfloat16), "expected [64] (from config.json hidden_size 64)"),
        ("model.layers.1.input_layernorm.weight", torch.ones((), dtype=torch.bfloat16), "has shape [], expected [64]"),
        # a 0-d linear weight: an IndexError (exit 1) before
        ("model.layers.0.self_attn.q_proj.weight", torch.ones((), dtype=torch.bfloat16), "is a scalar (shape [])"),
        # an integer norm where vLLM's parameter is bf16: a KeyError in the middle of the save (exit 1) before
        ("model.norm.weight", torch.ones(64, dtype=torch.int64), "is I64, where vLLM's model.norm.weight holds BF16"),
    ],
)
def test_damaged_tensors_exit_4_before_anything_is_written(tiny, tmp_path, name, value, says):
    from tests.fixtures.cli import run

    src = _replaced(tiny("llama"), tmp_path / "src", name, value)
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4, err
    assert says in err and name in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_tower_tensor_names_where_config_json_gives_its_size(tiny, tmp_path):
    src = tiny("qwen2.5-vl")
    tensors, _ = _read(src)
    name = next(k for k in tensors if k.endswith("blocks.0.norm1.weight"))
    bad = _replaced(src, tmp_path / "bad", name, tensors[name][:16].clone())
    with pytest.raises(SourceError) as e:
        build_plan(open_source(str(bad)).checkpoint, _layout(src))
    assert e.value.message.endswith("has shape [16], expected [32] (from config.json vision_config.hidden_size 32)")
