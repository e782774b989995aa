"""The rule tables as data: every style has a slicer, every fused module finds its slots in its
family's WeightsMapper, and experts under EP are placed as vLLM places them."""

from __future__ import annotations

import pytest

from reshard.plan.geometry import MoeSplit, ep_experts
from reshard.plan.slicers import SLICERS
from reshard.rules import ARCHITECTURES, QKV, Architecture, Merged, Rule, WeightsMapper, styles
from reshard.rules.qwen3_next import QWEN3_5_MOE
from reshard.rules.spec import stacked_params_mapping

STYLES = [c for c in vars(styles).values() if isinstance(c, type) and issubclass(c, Rule)]
ABSTRACT = {styles.Rule, styles.Sourced, styles.Linear}


def test_every_style_has_a_slicer():
    assert {c for c in STYLES if c not in ABSTRACT} == set(SLICERS)


def _rules(arch: Architecture) -> list[Rule]:
    mixers = [m for group in arch.mixers.by_type.values() for m in group] if arch.mixers else []
    return [*arch.top, *arch.layer, *mixers, *arch.dense_mlp, *arch.moe_mlp]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fused_modules_find_their_slots(name):
    arch = ARCHITECTURES[name]
    for m in _rules(arch):
        assert type(m) in SLICERS, f"{name}: {m.name} is a {type(m).__name__}"
        if isinstance(m, Merged | QKV) and not m.fused:
            slots = arch.shards(m.hf)
            assert len(slots) == (3 if isinstance(m, QKV) else len(m.sizes) or 2), (name, m.name, slots)


def test_stacked_shards_in_vllm_terms():
    mapper = WeightsMapper(
        orig_to_new_stacked={
            ".v_proj": (".qkv_proj", "v"),
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
        }
    )
    assert mapper.shards("self_attn.qkv_proj") == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert mapper.shards("mlp.gate_up_proj") == ()
    # a tuple shard id: one tensor, consecutive slots (Qwen3.5's in_proj_qkv)
    assert QWEN3_5_MOE.shards("linear_attn.in_proj_qkvz") == ("linear_attn.in_proj_qkv",) * 3 + (
        "linear_attn.in_proj_z",
    )
    # the older list spelling, without dots (DeepSeek's load_weights)
    old = WeightsMapper(stacked_params_mapping([("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]))
    assert old.shards("mlp.shared_experts.gate_up_proj") == (
        "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.up_proj",
    )
    with pytest.raises(AssertionError, match=r"0\.\.n-1"):
        WeightsMapper({".a": (".ab", 0), ".b": (".ab", 2)}).shards("x.ab")


def test_prefixes_inverted():
    assert (
        QWEN3_5_MOE.hf_name("language_model.model.layers.0.mlp.gate.weight")
        == "model.language_model.layers.0.mlp.gate.weight"
    )
    assert QWEN3_5_MOE.hf_name("language_model.lm_head.weight") == "lm_head.weight"
    assert QWEN3_5_MOE.hf_name("mtp.fc.weight") == "mtp.fc.weight"


def test_ep_placement_is_linear_with_the_remainder_first():
    assert [ep_experts(10, 4, r) for r in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [ep_experts(8, 4, r) for r in range(4)] == [range(2 * r, 2 * r + 2) for r in range(4)]
    split = MoeSplit(target="t", base="b", names=("g", "u", "d"), num=10, inter=8, hidden=8, tp=4, ep=True)
    assert [split.experts(r) for r in range(4)] == [ep_experts(10, 4, r) for r in range(4)]
    assert MoeSplit(target="t", base="b", names=("g", "u", "d"), num=10, inter=8, hidden=8, tp=4, ep=False).experts(
        3
    ) == range(10)
