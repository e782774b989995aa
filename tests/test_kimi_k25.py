"""Kimi-K2.5 (`KimiK25ForConditionalGeneration`, issue 27): MoonViT beside DeepSeek-V3, INT4 routed experts.

Byte-for-byte agreement with vLLM itself is tests/against_vllm/test_vllm.py (`# issue 27: Kimi-K2.5` block);
here the release plan against what vLLM 0.32 built from its config (tests/fixtures/releases/kimi-k2.5.json,
recorded by tests/against_vllm/release_shapes.py), the tower's split read as vLLM's loaders' formulas, the
head-count fallback, data mode, the INT4 release's unquantized tower, merge, re-shard and verify --deep.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.layout import Layout
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.reference import load_source
from tests.fixtures.releases import assert_rank_matches, vllm_shapes
from tests.fixtures.saving import rank_tensors, save
from tests.fixtures.vision_releases import CUT_LAYERS, RELEASES, cut, write_header_only
from tests.test_reshard_merge import assert_same, load_dir

B = "vision_tower.encoder.blocks.0."
LM = "language_model.model.layers.1.mlp.experts.routed_experts."
CODES = {**DTYPE_CODES, "I32": "int32", "I64": "int64"}  # the INT4 experts' packed weights and shapes


@pytest.mark.parametrize("layout", ["tp8", "tp8-ep"])
def test_release_plans_as_vllm_builds(tmp_path, layout):
    """The release's config (vision sizes in the hub's `vt_*` keys, which vLLM's config class ignores for its
    defaults) planned at TP 8: every rank's names, dtypes, shapes and bytes as vLLM built them."""
    expected = vllm_shapes("kimi-k2.5")
    assert expected["num_hidden_layers"] == CUT_LAYERS["kimi-k2.5"] and expected["tp"] == 8
    want = expected["layouts"][layout]
    folder = write_header_only(tmp_path / "kimi-k2.5", cut(RELEASES["kimi-k2.5"], CUT_LAYERS["kimi-k2.5"]))
    plan = build_plan(open_source(str(folder)).checkpoint, Layout(tp=8, ep=layout == "tp8-ep"))
    assert plan.serve_command("OUT").endswith("--mm-encoder-tp-mode weights --no-mm-device-do-normalize")
    names = {v: k for k, v in CODES.items()}
    for r in range(8):
        got = {t.name: [CODES[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == r for t in f.tensors}
        exp = want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)
        assert got[B + "wqkv.weight"] == ["bfloat16", [3 * 1152 // 8, 1152]]  # 16 heads of 72: 2 per rank
        assert plan.summary()["ranks"][r]["bytes"] == sum(math.prod(s) * ITEMSIZE[names[d]] for d, s in exp.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_tower_split_as_vllm_loads_it(tiny, tmp_path, tp):
    """wqkv [q; k; v] over 4 heads of 16, each cut by heads with its bias; wo and fc1 by input columns (bias
    whole); fc0 by rows; the patch embedding, pos_emb, norms and the projector (the release's proj.0 / proj.2,
    vLLM's linear_1 / linear_2) whole on every rank."""
    src = tiny("kimi-k2.5")
    save(str(src), tmp_path / "out", tp=tp, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    qkv, bias = hf[B + "wqkv.weight"], hf[B + "wqkv.bias"]
    for r in range(tp):
        got = rank_tensors(tmp_path / "out", r)
        assert torch.equal(got[B + "wqkv.weight"], torch.cat([p.chunk(tp)[r] for p in qkv.chunk(3)]))
        assert torch.equal(got[B + "wqkv.bias"], torch.cat([p.chunk(tp)[r] for p in bias.chunk(3)]))
        assert torch.equal(got[B + "wo.weight"], hf[B + "wo.weight"].chunk(tp, dim=1)[r])
        assert torch.equal(got[B + "wo.bias"], hf[B + "wo.bias"])
        assert torch.equal(got[B + "mlp.fc0.weight"], hf[B + "mlp.fc0.weight"].chunk(tp)[r])
        assert torch.equal(got[B + "mlp.fc0.bias"], hf[B + "mlp.fc0.bias"].chunk(tp)[r])
        assert torch.equal(got[B + "mlp.fc1.weight"], hf[B + "mlp.fc1.weight"].chunk(tp, dim=1)[r])
        for name in (
            "vision_tower.patch_embed.pos_emb.weight",
            "vision_tower.patch_embed.proj.weight",
            B + "norm0.bias",
        ):
            assert torch.equal(got[name], hf[name])
        assert torch.equal(got["mm_projector.linear_1.weight"], hf["mm_projector.proj.0.weight"])
        assert torch.equal(got["mm_projector.linear_2.bias"], hf["mm_projector.proj.2.bias"])
        assert "language_model.lm_head.weight" in got and LM + "w13_weight" in got


def test_data_mode_and_the_head_count_fallback_write_the_tower_whole(tiny, tmp_path):
    """--mm-encoder-tp-mode data: the tower whole on every rank. 3 vision heads at TP 2 in weights mode: vLLM's
    is_vit_use_data_parallel falls back to the same whole tower (no refusal, unlike Qwen-VL); the note says so."""
    for arch, mm in (("kimi-k2.5", "data"), ("kimi-k2.5-h3", None)):
        src = tiny(arch)
        result = save(str(src), tmp_path / arch, tp=2, mm=mm, max_part_size=DEFAULT_MAX_PART)
        assert result.plan.serve_command("OUT").endswith(
            f"--mm-encoder-tp-mode {mm or 'weights'} --no-mm-device-do-normalize"
        )
        assert any("not divisible by --tp 2: vLLM builds the vision encoder whole" in n for n in result.plan.notes) == (
            mm is None
        )
        hf = load_source(src, open_source(str(src)).checkpoint)
        for r in range(2):
            got = rank_tensors(tmp_path / arch, r)
            for k, v in hf.items():
                if k.startswith("vision_tower."):
                    assert torch.equal(got[k], v), k
            assert got[LM + "w2_weight"].shape[2] == 32  # the text model split: 64 / 2
    code, _, err = run("plan", str(tiny("kimi-k2.5-h3")), "--tp", "4")  # 3 heads, 4 ranks: whole again
    assert code == 0, err


def test_int4_release_tower_built_unquantized(tiny, tmp_path):
    """The INT4 release's ignore list (Kimi-K2-Thinking's) names no vision layer, yet vLLM builds the tower and
    projector without compressed-tensors (`_maybe_ignore_quant_config`): written bf16 as in the checkpoint; the
    routed experts packed, split by TP (32 rows of 64 per rank, one group of 32)."""
    src = tiny("kimi-k2.5-int4")
    ckpt = open_source(str(src)).checkpoint
    qc = ckpt.config["text_config"]["quantization_config"]  # where the release keeps it; vLLM reads it there
    ignored = [i[3:] for i in qc["ignore"] if i.startswith("re:")]
    assert not any(re.match(p, B + "wqkv") for p in ignored) and "quantization_config" not in ckpt.config
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, ckpt)
    for r in range(2):
        got = rank_tensors(tmp_path / "out", r)
        assert got[B + "wqkv.weight"].dtype == torch.bfloat16 and B + "wqkv.weight_packed" not in got
        assert torch.equal(got["mm_projector.linear_1.weight"], hf["mm_projector.proj.0.weight"])
        assert got[LM + "w13_weight_packed"].dtype == torch.int32
        assert got[LM + "w2_weight_scale"].shape == (8, 64, 1)  # [E, hidden, I_p / 32]
    code, _, err = run("plan", str(src), "--tp", "4")  # 16 rows per rank would cut a group of 32
    assert code == 3 and "not a multiple of the quantization group 32" in err


@pytest.mark.parametrize("arch", ["kimi-k2.5", "kimi-k2.5-int4"])
def test_merge_round_trips_byte_identical(tiny, tmp_path, arch):
    src = tiny(arch)
    save(str(src), tmp_path / "out", tp=2, ep=arch.endswith("int4"), max_part_size=DEFAULT_MAX_PART)
    result = merge(tmp_path / "out", tmp_path / "hf", max_shard_size=400_000)
    assert result["not_in_output"] == []
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))


def test_reshard_an_output_and_language_model_only(tiny, tmp_path):
    src = tiny("kimi-k2.5")
    save(str(src), tmp_path / "first", tp=2, max_part_size=DEFAULT_MAX_PART)
    save(str(tmp_path / "first"), tmp_path / "via", tp=4, mm="data", max_part_size=DEFAULT_MAX_PART)
    save(str(src), tmp_path / "direct", tp=4, mm="data", max_part_size=DEFAULT_MAX_PART)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))
    result = save(str(src), tmp_path / "lm", tp=2, lm_only=True, max_part_size=DEFAULT_MAX_PART)
    assert result.plan.serve_command("OUT").endswith("--language-model-only")
    got = rank_tensors(tmp_path / "lm", 0)
    assert not any(k.startswith(("vision_tower.", "mm_projector.")) for k in got)
    assert "language_model.model.embed_tokens.weight" in got


def test_verify_deep_against_the_source(tiny, tmp_path):
    src = tiny("kimi-k2.5-int4")
    save(str(src), tmp_path / "out", tp=2, ep=True, max_part_size=DEFAULT_MAX_PART)
    code, out, err = run("verify", str(tmp_path / "out"), "--against", str(src), "--deep")
    assert code == 0, out + err


def test_no_longer_refused_by_name():
    from reshard.rules import REFUSED, get_architecture

    assert "KimiK25ForConditionalGeneration" not in REFUSED
    assert get_architecture({"architectures": ["KimiK25ForConditionalGeneration"]})[1].towers


def test_encoder_variants_vllm_builds_from_settings(tiny, tmp_path):
    """Settings the release leaves at vLLM's defaults (kimi_k25_vit.py's getattr), set otherwise: RMSNorms
    (`norm_type: rmsnorm`, weights only), linears without biases (`attn_bias`, `linear_bias`), no patch
    embedding bias, the `patchmergerv2` projector (bias-free linears, an RMSNorm after them, no pre-norm).
    vLLM builds exactly these keys (tests/against_vllm: `kimi-k2.5-v2`); each rank holds the source's
    tensors, split as the default variant's."""
    src = tiny("kimi-k2.5-v2")
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    for r in range(2):
        got = rank_tensors(tmp_path / "out", r)
        tower = {k for k in got if k.startswith(("vision_tower.", "mm_projector."))}
        assert not any(k.endswith(".bias") for k in tower), sorted(tower)
        assert "mm_projector.pre_norm.weight" not in got
        assert torch.equal(got["mm_projector.post_norm.weight"], hf["mm_projector.post_norm.weight"])
        assert torch.equal(got[B + "norm0.weight"], hf[B + "norm0.weight"])
        assert torch.equal(got[B + "wo.weight"], hf[B + "wo.weight"].chunk(2, dim=1)[r])
        assert torch.equal(got[B + "mlp.fc0.weight"], hf[B + "mlp.fc0.weight"].chunk(2, dim=0)[r])


@pytest.mark.parametrize(
    "setting, value, lm_only, code, says",
    [
        ("norm_type", "groupnorm", False, 3, "vLLM's KimiK25ForConditionalGeneration does not build it"),
        ("norm_type", "groupnorm", True, 3, "fails to start"),  # vLLM still builds the encoder it drops
        ("mm_projector_type", "patchmergerv3", False, 3, '"patchmerger", "patchmergerv2"'),
        ("pos_emb_type", None, False, 3, "vision_config.pos_emb_type = null"),
        ("qkv_hidden_size", 32, False, 3, "reshard has no rule for this encoder variant"),
        ("qkv_hidden_size", 32, True, 0, ""),  # the encoder is not written
        ("qkv_hidden_size", 64, False, 0, ""),  # the hidden size: the same heads
    ],
)
def test_encoder_settings_not_built_are_refused(tiny, tmp_path, setting, value, lm_only, code, says):
    """A setting vLLM's model raises on (NotImplementedError) is exit 3 naming it, also with
    --language-model-only; one reshard has no rule for only where the encoder is written."""
    src = Path(shutil.copytree(tiny("kimi-k2.5"), tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    config["vision_config"][setting] = value
    (src / "config.json").write_text(json.dumps(config))
    got, _, err = run("plan", str(src), "--tp", "2", *(["--language-model-only"] if lm_only else []))
    assert got == code, err
    assert says in err and (code == 0 or err.count("\n") == 1), err
