"""Where an output's source tensors lie (`reshard.sources.output`): a layer's experts kept as one
group per rank (issue 28) give exactly the regions the piece-by-piece reading gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from reshard.checkpoint import Checkpoint
from reshard.folderview import LocalView, view_manifest
from reshard.format import ITEMSIZE, TensorInfo
from reshard.plan import DEFAULT_MAX_PART, build_plan, flat
from reshard.sources.local import read_config
from reshard.sources.output import VIRTUAL, _groups, _piece_regions, _tile, read_output
from reshard.sources.output_reader import Region, Regions
from tests.fixtures.saving import save


def piece_by_piece(out: Path) -> dict[str, list[Region]]:
    """The regions of every source tensor, every plan piece taken on its own (no groups)."""
    view = LocalView(out)
    manifest = view_manifest(view)
    assert manifest.source_tensors is not None
    config = {**read_config(out), "torch_dtype": manifest.layout.dtype}
    original = {
        n: TensorInfo(n, d, s, VIRTUAL, 0, math.prod(s) * ITEMSIZE[d]) for n, (d, s) in manifest.source_tensors.items()
    }
    plan = build_plan(Checkpoint(None, config, original, [VIRTUAL], manifest.source), manifest.layout)
    regions: dict[str, list[Region]] = {}
    dtypes: dict[str, str] = {}
    for f in plan.files:
        header, _, _ = view.header(f.name)
        for t in f.tensors:
            pos = header[t.name].offset
            for p in flat(t.pieces):
                pos = _piece_regions(str(out), f.name, pos, p, t.dtype, regions, dtypes)
    sizes: dict = {}
    return {n: _tile(n, original[n].shape, regs, sizes) for n, regs in regions.items()}


def covered(spans) -> dict[str, list[tuple[int, int]]]:
    """The spans of each file merged where they touch."""
    out: dict[str, list[tuple[int, int]]] = {}
    for file, a, b in sorted(spans):
        runs = out.setdefault(file, [])
        if runs and runs[-1][1] >= a:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return out


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("qwen3-moe", dict(tp=2)),
        ("qwen3-moe", dict(tp=4, ep=True)),
        ("qwen3-moe-fp8", dict(tp=4)),
        ("mixtral", dict(tp=2, ep=True)),
        ("qwen2-moe", dict(tp=2)),
    ],
)
def test_grouped_regions_are_the_piece_by_piece_regions(tiny, tmp_path, arch, layout):
    out = tmp_path / "out"
    save(str(tiny(arch)), out, max_part_size=DEFAULT_MAX_PART, **layout)
    view = LocalView(out)
    ckpt, regions = read_output(view, view_manifest(view), out, {"path": str(out)})
    assert regions.stacked, "no expert group was kept: the test would not test the groups"
    expected = piece_by_piece(out)
    assert set(regions) == set(expected) == set(ckpt.tensors)
    for name, regs in expected.items():
        assert regions[name] == regs, name
    item = {n: ITEMSIZE[t.dtype] for n, t in ckpt.tensors.items()}
    want = Regions(expected, {}).spans(item.__getitem__)
    assert covered(regions.spans(item.__getitem__)) == covered(want)


def test_a_stack_whose_source_is_held_twice_is_read_as_plain_regions():
    shape = (4, 6)
    original = {n: TensorInfo(n, "BF16", shape, VIRTUAL, 0, 48) for n in ("a", "b", "c")}
    half = ((0, 0), (2, 6)), ((2, 0), (4, 6))
    stacks = {
        ("a", "b"): ["BF16", *(("r0", 100, *half[0], 24), ("r1", 100, *half[1], 24))],
        ("b", "c"): ["BF16", *(("r2", 0, *half[0], 24), ("r3", 0, *half[1], 24))],
    }
    plain: dict[str, list[Region]] = {}
    stacked = _groups(original, stacks, plain, {})
    assert stacked == {} and set(plain) == {"a", "b", "c"}
    assert plain["b"] == [
        Region("r0", 124, *half[0], None, None),
        Region("r1", 124, *half[1], None, None),
        Region("r2", 0, *half[0], None, None),
        Region("r3", 0, *half[1], None, None),
    ]


def test_a_group_that_does_not_cover_its_sources_is_refused():
    from reshard.errors import SourceError

    original = {n: TensorInfo(n, "BF16", (4, 6), VIRTUAL, 0, 48) for n in ("a", "b")}
    stacks = {("a", "b"): ["BF16", ("r0", 0, (0, 0), (2, 6), 24)]}
    with pytest.raises(SourceError, match="do not cover"):
        _groups(original, stacks, {}, {})


def test_replicated_parts_are_read_once():
    original = {n: TensorInfo(n, "BF16", (4, 6), VIRTUAL, 0, 48) for n in ("a", "b")}
    whole = ((0, 0), (4, 6))
    stacks = {("a", "b"): ["BF16", ("r0", 0, *whole, 48), ("r1", 64, *whole, 48)]}
    stacked = _groups(original, stacks, {}, {})
    regions = Regions({}, stacked)
    assert regions["b"] == [Region("r0", 48, *whole, None, None)]
    assert list(regions.spans(lambda _: 2)) == [("r0", 0, 96)]
