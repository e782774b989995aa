"""The executor's two ways of emitting a tensor give the same bytes: one pass over each source (the
usual way) and one read per piece (for piece orders one pass cannot serve, rare in real plans)."""

from __future__ import annotations

import pytest

import reshard.execute as ex
import reshard.schedule as schedule
from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART
from reshard.sources import open_source
from tests.fixtures.saving import save

CASES = [
    ("llama", 4, False),
    ("phi3", 2, False),
    ("qwen3-moe-fp8", 2, False),
    ("qwen3-moe-fp8", 4, True),
    ("deepseek-v3-fp8", 4, False),
]


@pytest.mark.parametrize("arch, tp, ep", CASES, ids=[f"{a}-tp{t}{'-ep' if e else ''}" for a, t, e in CASES])
def test_read_per_piece_equals_one_pass(tiny, tmp_path, monkeypatch, arch, tp, ep):
    src = tiny(arch)
    streamed = save(str(src), tmp_path / "a", tp=tp, ep=ep, max_part_size=DEFAULT_MAX_PART, chunk_bytes=1000)
    survey = schedule._survey
    monkeypatch.setattr(schedule, "_survey", lambda tensors: (*survey(tensors)[:2], False))  # not streamable
    steps = schedule.schedule(streamed.plan, open_source(str(src)).checkpoint.tensors, 1000)
    assert all(r.piece is not None for s in steps for r in s.reads)
    save(str(src), tmp_path / "b", tp=tp, ep=ep, max_part_size=DEFAULT_MAX_PART, chunk_bytes=1000)
    for f in streamed.plan.files:  # the data sections (headers differ in their run id)
        a, b = ((tmp_path / d / f.name).read_bytes() for d in "ab")
        assert a[8 + int.from_bytes(a[:8], "little") :] == b[8 + int.from_bytes(b[:8], "little") :], f.name


def test_a_tensor_short_of_its_declared_bytes_is_refused(tiny, tmp_path):
    """Defence in depth behind the planner's shape checks: a file whose tensor got fewer bytes than
    its header declares would be unreadable; the writer refuses it (exit 4), nothing is published."""
    from reshard.errors import SourceError
    from reshard.io.reader import FileReader
    from reshard.plan import OutFile, OutTensor, Slice
    from reshard.plan import build_plan as plan_of

    src = open_source(str(tiny("llama")))
    ckpt = src.checkpoint
    norm = ckpt.tensors["model.norm.weight"]
    half = Slice(norm.name, (0,), (norm.shape[0] // 2,))
    bad = OutTensor("model.norm.weight", norm.dtype, norm.shape, (half,))
    plan = plan_of(ckpt, Layout(tp=1))
    plan.files = [OutFile("model-rank-0-part-0.safetensors", 0, 0, 0, (bad,))]
    with pytest.raises(SourceError, match="header declares"):
        options = ex.WriteOptions(checksum="blake3", max_memory=64 * 2**20)
        ex.Executor(plan, FileReader(ckpt.root), ckpt.tensors, tmp_path, options, metadata={}).run()
