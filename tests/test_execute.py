"""The executor's two ways of emitting a tensor give the same bytes: one pass over each source (the
usual way) and one read per piece (for piece orders one pass cannot serve, rare in real plans)."""

from __future__ import annotations

import pytest

import reshard.execute as ex
from reshard.plan import DEFAULT_MAX_PART
from reshard.save import save
from reshard.sources import open_source

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
    monkeypatch.setattr(ex, "_streamable", lambda tensors, sources: False)
    steps = ex.schedule(streamed.plan, open_source(str(src)).checkpoint.tensors, 1000)
    assert all(r.piece is not None for s in steps for r in s.reads)
    save(str(src), tmp_path / "b", tp=tp, ep=ep, max_part_size=DEFAULT_MAX_PART, chunk_bytes=1000)
    for f in streamed.plan.files:  # the data sections (headers differ in their run id)
        a, b = ((tmp_path / d / f.name).read_bytes() for d in "ab")
        assert a[8 + int.from_bytes(a[:8], "little") :] == b[8 + int.from_bytes(b[:8], "little") :], f.name
