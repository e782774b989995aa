"""Llama-4 text (Llama4ForConditionalGeneration under --language-model-only, and Llama4ForCausalLM).

Byte-for-byte agreement with vLLM itself is `tests/against_vllm/test_vllm.py` (llama4 cases); here the
experts are checked against vLLM 0.32's `Llama4Model.load_moe_expert_weights` read as formulas, the
streamed files against an independent torch reading of the plan.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.reference import assert_streamed_files_equal_plan, load_source
from tests.fixtures.saving import rank_tensors, save

LM = "language_model.model.layers."


@pytest.mark.parametrize("arch, tp, ep", [("llama4", 2, False), ("llama4", 4, True), ("llama4-text", 4, False)])
def test_streamed_files_equal_plan(tiny, tmp_path, arch, tp, ep):
    assert_streamed_files_equal_plan(tiny(arch), tmp_path / "out", tp=tp, ep=ep)


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_as_vllm_loads_them(tiny, tmp_path, tp):
    """gate_up_proj [E, hidden, 2I] transposed and halved: w13 = [gate rows s:s+ip; up rows s:s+ip]; w2 =
    down_proj[:, s:s+ip, :] transposed; the shared expert under the runner's alias; no vision tensor."""
    src = tiny("llama4")
    result = save(str(src), tmp_path / "out", tp=tp, max_part_size=DEFAULT_MAX_PART)
    assert result.plan.serve_command("OUT").endswith("--language-model-only")
    hf = load_source(src, open_source(str(src)).checkpoint)
    inter = 64
    ip = inter // tp
    gu, dn = hf[LM + "1.feed_forward.experts.gate_up_proj"], hf[LM + "1.feed_forward.experts.down_proj"]
    for r in range(tp):
        got = {}
        for f in (tmp_path / "out").glob(f"model-rank-{r}-part-*.safetensors"):
            with safe_open(str(f), "pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
        assert not [k for k in got if k.startswith(("vision_model", "multi_modal_projector"))]
        e = LM + "1.feed_forward.experts.routed_experts."
        s = r * ip
        want13 = torch.cat([gu[:, :, s : s + ip], gu[:, :, inter + s : inter + s + ip]], dim=2).transpose(1, 2)
        assert torch.equal(got[e + "w13_weight"], want13)
        assert torch.equal(got[e + "w2_weight"], dn[:, s : s + ip, :].transpose(1, 2))
        shared = LM + "1.feed_forward.experts._shared_experts._layer.down_proj.weight"
        assert torch.equal(got[shared], hf[LM + "1.feed_forward.shared_expert.down_proj.weight"].chunk(tp, dim=1)[r])
        # permute_qk_weight_for_rotary: per head, even rows then odd rows (q by heads here, 8 heads of 32)
        q = hf[LM + "0.self_attn.q_proj.weight"].view(8, 16, 2, 64).transpose(1, 2).reshape(256, 64)
        assert torch.equal(got[LM + "0.self_attn.qkv_proj.weight"][: 256 // tp], q.chunk(tp)[r])
        assert LM + "0.feed_forward.gate_up_proj.weight" in got  # layer 0 dense (interleave step 2)
        assert got[LM + "0.feed_forward.gate_up_proj.weight"].shape == (2 * 128 // tp, 64)


def test_text_only_checkpoint_same_layout(tiny):
    """Llama4ForCausalLM holds the same text model without the language_model. prefix."""
    multi = build_plan(open_source(str(tiny("llama4"))).checkpoint, Layout(tp=2))
    text = build_plan(open_source(str(tiny("llama4-text"))).checkpoint, Layout(tp=2))

    def shapes(plan, strip):
        return {t.name.removeprefix(strip): (t.dtype, t.shape) for f in plan.files if f.tp_rank == 1 for t in f.tensors}

    assert shapes(multi, "language_model.") == shapes(text, "")
    assert "--language-model-only" not in text.serve_command("OUT")


def test_experts_read_once(tiny):
    """The gate and up halves of an expert are two pieces of one source row: still one pass over the source."""
    from reshard.schedule import schedule

    src = tiny("llama4")
    ckpt = open_source(str(src)).checkpoint
    plan = build_plan(ckpt, Layout(tp=2))
    name = LM + "1.feed_forward.experts.routed_experts.w13_weight"
    (step,) = [s for s in schedule(plan, ckpt.tensors, 1000) if s.name == name]
    assert all(r.piece is None for r in step.reads)  # fed to every rank, not read per piece
    assert sum(r.nbytes for r in step.reads) == ckpt.tensors[LM + "1.feed_forward.experts.gate_up_proj"].nbytes


def test_ep_places_fused_experts_unevenly_as_vllm_does(tiny, tmp_path):
    """3 experts over 2 ranks with --ep: vLLM's linear expert map gives rank 0 experts 0 and 1, rank 1 expert 2
    (the generic expert loader Llama-4 uses; vLLM's own state: tests/against_vllm, `llama4-e3` TP 2 + EP). It was
    refused, with the reason of gpt-oss's loader (E // tp each), which still refuses it."""
    src = tiny("llama4-e3")
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2", "--ep")
    assert code == 0, err
    got = [rank_tensors(tmp_path / "out", r) for r in range(2)]
    w2 = next(k for k in got[0] if k.endswith("routed_experts.w2_weight"))
    assert [g[w2].shape[0] for g in got] == [2, 1]
