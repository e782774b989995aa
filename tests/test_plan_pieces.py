"""The planner's bulk paths (issue 28) plan exactly what the straightforward path plans.

An MoE layer's expert pieces are built for all experts of a rank at once (`padded_rows_each`,
`padded_cols_each`, `slices`: bounds shared, no dataclass __init__), its tensors looked up in bulk
(`Context.src_each`), and the KV-cache scale regexes run only on names with a KV-scale ending. Here
every planned file, tensor and piece (and the notes and layout) of several architectures and layouts
is digested both ways: with those paths, and with each replaced by the one-object-at-a-time code
they stand for.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, replace

import pytest

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.layout import Layout
from reshard.plan import build_plan, experts, flat, kvscales, model, quant
from reshard.plan.context import Context
from reshard.plan.expertblocks import RankScales, moe_block
from reshard.plan.geometry import MoeSplit, Sources, cdiv
from reshard.plan.model import (
    Fill,
    OutTensor,
    Slice,
    Stack,
    padded_cols,
    padded_cols_each,
    padded_rows,
    padded_rows_each,
    slices,
)
from reshard.plan.slicers import SLICERS
from reshard.rules import Experts
from reshard.rules.spec import WeightsMapper
from reshard.schedule import schedule
from reshard.sources import open_source
from tests.fixtures.releases import CUT_LAYERS, RELEASES, cut, write_header_only
from tests.fixtures.synthetic import QWEN3_30B_A3B, QWEN3_235B_A22B_FP8, synthetic_checkpoint


def old_experts(ctx, m, prefix, per_tp) -> None:
    """reshard.plan.experts.experts as it was before issue 28 (verbatim, but for the imports)."""
    split = experts._split(ctx, m, prefix)
    scheme = ctx.quant if ctx.quantized([split.base], experts=True) else None
    split = experts._allocation(ctx, split, scheme)
    if scheme is not None and scheme.k_first:
        rank = scheme.expert_scales(ctx, split)
        for r in range(ctx.tp):
            per_tp[r].extend(rank(r))
        return
    weights = old_weights(ctx, split, scheme)
    scales = scheme.expert_scales(ctx, split) if scheme else None
    wdtype = scheme.weight_dtype if scheme else ctx.dtype
    param, pk = (scheme.weight_param, scheme.pack) if scheme else ("weight", 1)
    width, hidden = split.width, split.hidden
    for r in range(ctx.tp):
        local = split.experts(r)
        start, size = split.real(r)
        w13 = tuple(
            p for e in local for w in weights[e][:2] for p in padded_rows(w.name, start, size, width, hidden // pk, 0.0)
        )
        w2 = tuple(padded_cols(weights[e][2].name, hidden, start // pk, size // pk, width // pk, 0.0) for e in local)
        n = len(local)
        per_tp[r].append(OutTensor(f"{split.target}.w13_{param}", wdtype, (n, 2 * width, hidden // pk), w13))
        per_tp[r].append(OutTensor(f"{split.target}.w2_{param}", wdtype, (n, hidden, width // pk), w2))
        if scales:
            per_tp[r].extend(scales(r))


def old_weights(ctx, split, scheme):
    inter, hidden = split.inter, split.hidden
    param, pk = (scheme.weight_param, scheme.pack) if scheme else ("weight", 1)
    if split.ip % pk or hidden % pk:
        raise UnsupportedError(
            f"{split.target}: per-rank intermediate size {split.ip} or hidden size {hidden} cuts the weights "
            f"packed {pk} to an int32",
            "use --ep, or a smaller --tp",
        )
    gate, up, down = split.names
    out = []
    for e in range(split.num):
        g, u, dn = (split.tensor(ctx, e, proj, param) for proj in (gate, up, down))
        for w, shape in ((g, (inter, hidden // pk)), (u, (inter, hidden // pk)), (dn, (hidden, inter // pk))):
            if w.shape != shape:
                raise SourceError(f"{w.name} has shape {list(w.shape)}, expected {list(shape)}")
            if scheme:
                scheme.check_weight(w)
        out.append((g, u, dn))
    return out


def old_block_expert_scales(
    block: tuple[int, int], refines: bool, scale_name: str, sources: Sources, split: MoeSplit
) -> RankScales:
    """reshard.plan.expertblocks.block_expert_scales before issue 28 (verbatim, but for the imports)."""
    (bn, bk), upf = moe_block(block, refines, sources, split)
    up = upf if upf != (1, 1) else None
    width = split.width
    nr13, nc13 = cdiv(width, bn), cdiv(split.hidden, bk)
    nr2, nc2 = cdiv(split.hidden, bn), cdiv(width, bk)
    g13 = (cdiv(split.inter, bn), nc13)  # the checkpoint's grids
    g2 = (nr2, cdiv(split.inter, bk))
    gate, up_proj, down = split.names
    s13: list[tuple[TensorInfo, TensorInfo]] = []
    s2: list[TensorInfo] = []
    for e in range(split.num):
        pair = (split.tensor(sources, e, gate, scale_name), split.tensor(sources, e, up_proj, scale_name))
        s = split.tensor(sources, e, down, scale_name)
        if split.blocked:
            bad = [t for t, g in ((pair[0], g13), (pair[1], g13), (s, g2)) if t.shape != g]
        else:
            bad = [t for t in pair if (t.shape[0] * upf[0]) // split.moe_tp != nr13 or t.shape[1] * upf[1] != nc13]
            if (s.shape[1] * upf[1]) // split.moe_tp != nc2 or s.shape[0] * upf[0] != nr2:
                bad.append(s)
        if bad:
            raise UnsupportedError(f"{bad[0].name}: FP8 block scales do not tile this split")
        s13.append(pair)
        s2.append(s)

    def rank(r: int) -> list[OutTensor]:
        experts = split.experts(r)
        start, size = split.real(r)
        if split.blocked:  # whole blocks: start and size are multiples of the block
            r13, n13 = start // bn, size // bn
            c2, n2 = start // bk, size // bk
            p13 = tuple(p for e in experts for s in s13[e] for p in padded_rows(s.name, r13, n13, nr13, nc13, 1.0))
            p2 = tuple(padded_cols(s2[e].name, nr2, c2, n2, nc2, 1.0) for e in experts)
        else:
            r13, c2 = nr13 * split.shard(r), nc2 * split.shard(r)
            b13 = ((r13, 0), (r13 + nr13, nc13))  # bounds shared by every expert
            b2 = ((0, c2), (nr2, c2 + nc2))
            p13 = tuple(Slice(s.name, *b13, up) for e in experts for s in s13[e])
            p2 = tuple(Slice(s2[e].name, *b2, up) for e in experts)
        n = len(experts)
        return [
            OutTensor(f"{split.target}.w13_{scale_name}", "F32", (n, 2 * nr13, nc13), p13),
            OutTensor(f"{split.target}.w2_{scale_name}", "F32", (n, nr2, nc2), p2),
        ]

    return rank


def one_by_one(monkeypatch) -> None:
    """The straightforward path: the experts planned as before (a dataclass per piece, one padded_rows /
    padded_cols and one `src` per expert), every other piece built by the dataclass, every name through
    the KV-cache regexes, every name mapped by prefix."""

    def hf_names(self, name):
        prefixes = self.orig_to_new_prefix
        found = [orig + name[len(new) :] for orig, new in prefixes.items() if name.startswith(new)]
        if not any(name.startswith(orig) for orig in prefixes):
            found.append(name)
        return tuple(dict.fromkeys(found))

    monkeypatch.setitem(SLICERS, Experts, old_experts)

    def one_each(names, start, stop, up=None, pad=None, fill=0.0):
        return [Slice(n, start, stop, up, pad, fill) for n in names]

    monkeypatch.setattr(model, "slices", one_each)
    monkeypatch.setattr(quant, "block_expert_scales", old_block_expert_scales)
    monkeypatch.setattr(Context, "src_each", lambda self, names: None)
    monkeypatch.setattr(kvscales, "KV_ENDINGS", ("",))
    monkeypatch.setattr(WeightsMapper, "hf_names", hf_names)


def digest(plan) -> tuple[str, int]:
    """A digest of every file, tensor and piece of the plan (each expert `Stack` as its slices), its
    notes and layout; how many pieces."""
    h = hashlib.sha256()
    pieces = 0
    for f in plan.files:
        tensors = tuple(replace(t, pieces=flat(t.pieces)) for t in f.tensors)
        h.update(repr(replace(f, tensors=tensors)).encode())
        pieces += sum(len(t.pieces) for t in tensors)
    h.update(repr((plan.layout, plan.notes, plan.config_patch, plan.serve_flags)).encode())
    return h.hexdigest(), pieces


def both(monkeypatch, make, layout: Layout) -> tuple[tuple[str, int], tuple[str, int]]:
    fast = digest(build_plan(make(), layout))
    with monkeypatch.context() as m:
        one_by_one(m)
        slow = digest(build_plan(make(), layout))
    return fast, slow


def layers(config: dict, n: int) -> dict:
    return {**config, "num_hidden_layers": n}


SYNTHETIC = {
    "qwen3-30b-bf16": layers(QWEN3_30B_A3B, 2),
    "qwen3-235b-fp8": layers(QWEN3_235B_A22B_FP8, 2),
}
LAYOUTS = {
    "tp1": Layout(tp=1),
    "tp2": Layout(tp=2),
    "tp4-ep": Layout(tp=4, ep=True),
    "tp8": Layout(tp=8),
    "tp8-ep": Layout(tp=8, ep=True),
    "tp2-pp2": Layout(tp=2, pp=2),
    "tp4-trtllm": Layout(tp=4, moe_backend="flashinfer_trtllm"),  # padded experts: fills between slices
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_headers_plan_the_same_pieces(monkeypatch, name, layout):
    if name.endswith("fp8") and layout.endswith("trtllm"):
        pytest.skip("block FP8 experts pad by whole blocks only with FP8 backends (tested with the bf16 model)")
    fast, slow = both(monkeypatch, lambda: synthetic_checkpoint(SYNTHETIC[name], files=3), LAYOUTS[layout])
    assert fast == slow
    assert fast[1] > 2 * 128, "the plan has the experts' pieces"


TINY = ["qwen3-moe", "qwen3-moe-fp8", "deepseek-v3-fp8", "deepseek-v2-lite", "mixtral", "gpt-oss", "llama4", "llama"]


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(tp=2, ep=True), Layout(tp=4, ep=True)], ids=str)
@pytest.mark.parametrize("arch", TINY)
def test_tiny_checkpoints_plan_the_same_pieces(monkeypatch, tiny, arch, layout):
    src = tiny(arch, shards=2)
    if arch == "llama" and layout.ep:
        pytest.skip("a dense model has no --ep")
    try:
        fast, slow = both(monkeypatch, lambda: open_source(str(src)).checkpoint, layout)
    except Exception as e:  # a layout this tiny model cannot take: both paths must refuse it alike
        with monkeypatch.context() as m, pytest.raises(type(e), match="^" + _re(str(e)) + "$"):
            one_by_one(m)
            build_plan(open_source(str(src)).checkpoint, layout)
        return
    assert fast == slow


@pytest.mark.parametrize("layout", [Layout(tp=8), Layout(tp=8, ep=True)], ids=str)
@pytest.mark.parametrize("release", ["kimi-k2", "kimi-k2-thinking", "minimax-m2", "glm-4.6"])
def test_release_headers_plan_the_same_pieces(monkeypatch, tmp_path, release, layout):
    folder = write_header_only(tmp_path / release, cut(RELEASES[release], CUT_LAYERS[release]))  # a MoE layer too
    fast, slow = both(monkeypatch, lambda: open_source(str(folder)).checkpoint, layout)
    assert fast == slow


def test_missing_expert_is_named_as_before(monkeypatch):
    config = layers(QWEN3_30B_A3B, 1)

    def make():
        ckpt = synthetic_checkpoint(config)
        del ckpt.tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
        return ckpt

    errors = []
    for bulk in (True, False):
        with monkeypatch.context() as m:
            if not bulk:
                one_by_one(m)
            with pytest.raises(Exception) as e:
                build_plan(make(), Layout(tp=2))
            errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1] and "experts.5.up_proj" in errors[0][1]


# ---- the helpers themselves ------------------------------------------------------------------


def test_slices_are_the_dataclass_objects():
    names = ["a.0.w", "a.1.w", "a.2.w"]
    for kwargs in ({}, {"up": (2, 2)}, {"pad": (4, 8), "fill": 1.0}):
        built = slices(names, (1, 0), (3, 8), **kwargs)
        want = [Slice(n, (1, 0), (3, 8), **kwargs) for n in names]
        assert built == want
        for b, w in zip(built, want, strict=True):
            assert [getattr(b, f.name) for f in fields(Slice)] == [getattr(w, f.name) for f in fields(Slice)]
            assert type(b) is Slice and hash(b) == hash(w)


@pytest.mark.parametrize("start, size, width", [(0, 4, 4), (4, 4, 4), (4, 3, 4), (8, 0, 4), (0, 2, 6)])
def test_padded_each_equals_one_by_one(start, size, width):
    names = [f"e.{i}" for i in range(5)]
    rows = padded_rows_each(names, start, size, width, 16, 0.0)
    assert flat(rows) == tuple(p for n in names for p in padded_rows(n, start, size, width, 16, 0.0))
    cols = padded_cols_each(names, 16, start, size, width, 1.0)
    unpadded = lambda p: replace(p, fill=0.0) if isinstance(p, Slice) and p.pad is None else p  # noqa: E731 (fill unused)
    assert tuple(map(unpadded, flat(cols))) == tuple(
        unpadded(padded_cols(n, 16, start, size, width, 1.0)) for n in names
    )
    assert any(isinstance(p, Fill) for p in rows) == (width > size)
    # unpadded: one Stack, its numel the slices'; padded: the slices themselves
    for got in (rows, cols):
        assert (len(got) == 1 and isinstance(got[0], Stack)) == (0 < size == width)
        assert sum(p.numel for p in got) == sum(p.numel for p in flat(got))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_kv_scale_names_map_as_through_every_regex(monkeypatch):
    """Only names with a KV-scale ending go through the regexes: every other maps to None either way."""
    heads = ["model.layers.3.self_attn", "model.layers.3.mixer", "model.layers.3.self_attn.attn", "lm_head"]
    mids = ["", ".k_proj", ".v_proj", ".q_proj", ".qkv_proj", ".qkqkv_proj", ".q", ".k_cache", ".v_cache", ".attn"]
    tails = ["kv_scale", "k_scale", "v_scale", "q_scale", "prob_scale", "scale", "output_scale", "prob_output_scale",
             "k_zero_point", "q_zero_point", "weight_scale", "input_scale", "weight_scale_inv", "weight", "bias",
             "weight_packed", "k_scale_inv", "scales"]  # fmt: skip
    names = [f"{h}{m}.{t}" for h in heads for m in mids for t in tails]
    for fp8 in (False, True):
        fast = [kvscales.vllm_kv_name(n, fp8_config=fp8) for n in names]
        with monkeypatch.context() as m:
            m.setattr(kvscales, "KV_ENDINGS", ("",))
            slow = [kvscales.vllm_kv_name(n, fp8_config=fp8) for n in names]
        assert fast == slow
        assert sum(x is not None for x in fast) > 20


def stripped(plan) -> list:
    """Everything `reshard plan` shows of a plan: files, tensor names, dtypes, shapes; notes, layout."""
    files = [
        (f.name, f.tp_rank, f.pp_rank, f.part, [(t.name, t.dtype, t.shape) for t in f.tensors]) for f in plan.files
    ]
    return [files, plan.layout, plan.notes, plan.config_patch, plan.serve_flags, plan.total_bytes]


@pytest.mark.parametrize("layout", ["tp2", "tp8", "tp8-ep", "tp2-pp2", "tp4-trtllm"])
@pytest.mark.parametrize("name", SYNTHETIC)
def test_layout_only_plans_are_the_plans_without_pieces(name, layout):
    if name.endswith("fp8") and layout.endswith("trtllm"):
        pytest.skip("block FP8 experts pad by whole blocks only with FP8 backends")
    ckpt = synthetic_checkpoint(SYNTHETIC[name], files=3)
    full = build_plan(ckpt, LAYOUTS[layout])
    only = build_plan(ckpt, LAYOUTS[layout], pieces=False)
    assert only.layout_only and not full.layout_only
    assert stripped(only) == stripped(full)
    assert sum(len(t.pieces) for f in only.files for t in f.tensors) < sum(
        len(t.pieces) for f in full.files for t in f.tensors
    )
    with pytest.raises(AssertionError, match="layout-only"):
        schedule(only, ckpt.tensors, 1 << 20)


@pytest.mark.parametrize("release", ["kimi-k2", "kimi-k2-thinking"])
def test_layout_only_release_plans_are_the_plans_without_pieces(tmp_path, release):
    folder = write_header_only(tmp_path / release, cut(RELEASES[release], CUT_LAYERS[release]))  # a MoE layer too
    ckpt = open_source(str(folder)).checkpoint
    for layout in (Layout(tp=8), Layout(tp=8, ep=True)):
        assert stripped(build_plan(ckpt, layout, pieces=False)) == stripped(build_plan(ckpt, layout))
