"""Issue 27: DeepSeek-V3.2 / GLM-5 (DSA indexer, key names per vLLM platform), Qwen3_5MoeForCausalLM (text-only
Qwen3.5-MoE) and Glm4MoeLiteForCausalLM (GLM-4.7-Flash): plans from tiny checkpoints named as the releases
name their tensors (tests/fixtures/tiny.py), files against torch, the platform recorded and checked, merge.

Byte-for-byte agreement with vLLM 0.32 CPU is tests/against_vllm/test_vllm.py (its issue 27 block).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.errors import UnsupportedError
from reshard.layout import Layout
from reshard.manifest import read_manifest
from reshard.plan import build_plan
from reshard.sources import open_source
from reshard.vllm_plugin import checks, messages
from tests.fixtures.cli import run
from tests.fixtures.reference import assert_streamed_files_equal_plan
from tests.fixtures.tiny import quantize_block_fp8

L1 = "model.layers.1."


def shapes(plan, tp_rank=0, pp_rank=0):
    return {
        t.name: (t.dtype, t.shape)
        for f in plan.files
        if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank)
        for t in f.tensors
    }


def plan_of(src, **layout):
    return build_plan(open_source(str(src)).checkpoint, Layout(**layout))


# ---- DSA: the indexer ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deepseek-v32", "glm5"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_indexer_replicated_on_every_rank(tiny, arch, tp):
    plan = plan_of(tiny(arch), tp=tp)
    for r in range(tp):
        s = shapes(plan, r)
        idx = L1 + "self_attn.indexer."
        assert s[idx + "wq_b.weight"] == ("BF16", (4 * 128, 64))  # [n_idx * d_idx, q_lora_rank], whole
        assert s[idx + "wk_weights_proj.weight"] == ("BF16", (128 + 4, 64))  # [d_idx + n_idx, H]
        assert s[idx + "k_norm.weight"] == ("F32", (128,))  # LayerNorm(dtype=float32)
        assert s[idx + "k_norm.bias"] == ("F32", (128,))
        assert not any(".layers.4." in n for n in s)  # the MTP layer: the draft model's
        assert s[L1 + "self_attn.q_b_proj.weight"] == ("BF16", (4 * 96 // tp, 64))  # CUDA names by default
        assert s[L1 + "self_attn._k_scale"] == ("F32", ())


def test_platform_names_cuda_and_cpu(tiny):
    src = tiny("deepseek-v32")
    cuda, cpu = plan_of(src, tp=2, platform="cuda"), plan_of(src, tp=2, platform="cpu")
    assert cuda.layout.platform == "cuda" and cpu.layout.platform == "cpu"
    assert plan_of(src, tp=2).layout.platform == "cuda"  # None asked (a Layout()): CUDA, vLLM's default
    from tests.against_vllm.dsa_names import cuda_to_cpu

    a, b = shapes(cuda, 1), shapes(cpu, 1)
    assert {cuda_to_cpu(n): v for n, v in a.items()} == b  # only names differ, and exactly as documented
    assert L1 + "self_attn.mla_attn.o_proj.weight" in b and L1 + "self_attn.mla_attn.mla_attn._k_scale" in b
    assert L1 + "self_attn.o_proj.weight" in a and L1 + "self_attn.indexer.wq_b.weight" in b
    assert any("on CUDA" in n for n in cuda.notes)


def test_platform_is_recorded_only_where_names_depend_on_it(tiny):
    assert plan_of(tiny("llama"), tp=2, platform="cpu").layout.platform is None
    assert plan_of(tiny("glm4.7-flash"), tp=2, platform="cpu").layout.platform is None


def test_rocm_refused_with_reason(tiny):
    with pytest.raises(UnsupportedError, match="ROCm DSA class") as e:
        plan_of(tiny("deepseek-v32"), tp=2, platform="rocm")
    assert "--platform cuda or --platform cpu" in e.value.hint
    code, _, err = run("plan", str(tiny("glm5")), "--tp", "2", "--platform", "rocm")
    assert code == 3 and "AITER" in err


def test_files_equal_torch(tiny, tmp_path):
    """wk_weights_proj = [wk; weights_proj] whole on every rank; k_norm upcast to float32 exactly."""
    src = tiny("deepseek-v32")
    assert_streamed_files_equal_plan(src, tmp_path / "out", tp=2, ep=True)
    hf = load_file(str(src / "model.safetensors"))
    idx = L1 + "self_attn.indexer."
    for r in range(2):
        with safe_open(str(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors"), "pt") as h:
            fused = h.get_tensor(idx + "wk_weights_proj.weight")
            assert torch.equal(fused, torch.cat([hf[idx + "wk.weight"], hf[idx + "weights_proj.weight"]]))
            assert torch.equal(h.get_tensor(idx + "wq_b.weight"), hf[idx + "wq_b.weight"])
            for p in ("weight", "bias"):
                assert torch.equal(h.get_tensor(idx + f"k_norm.{p}"), hf[idx + f"k_norm.{p}"].float())


def _with(src, tmp_path, name, change):
    """A copy of checkpoint `src` whose tensors (dict) and config (dict) `change` edits in place."""
    dst = tmp_path / name
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    change(sd, config)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def scaled_dequantize_reference(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """vLLM quant_utils.scaled_dequantize with group_shape (rows // s_rows, cols // s_cols), out bfloat16."""
    g0, g1 = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
    full = s.to(torch.float32).repeat_interleave(g0, 0).repeat_interleave(g1, 1)
    return (w.to(torch.float32) * full).to(torch.bfloat16)


def _fp8_wk(sd, config):
    for k in [k for k in sd if k.endswith("indexer.wk.weight")]:
        sd[k], sd[k + "_scale_inv"] = quantize_block_fp8(sd[k], (64, 32))  # 2 x 2 blocks of [128, 64]


def test_fp8_wk_dequantised_as_vllm(tiny, tmp_path):
    """Releases that store indexer.wk in FP8: vLLM dequantises it at load (deepseek_v2._try_load_fp8_indexer_wk:
    scaled_dequantize, fp8 and scale to float32, product rounded to bfloat16) into wk_weights_proj's rows."""
    src = _with(tiny("deepseek-v32"), tmp_path, "fp8wk", _fp8_wk)
    out = tmp_path / "out"
    assert_streamed_files_equal_plan(src, out, tp=2)
    hf = load_file(str(src / "model.safetensors"))
    idx = L1 + "self_attn.indexer."
    want = torch.cat(
        [
            scaled_dequantize_reference(hf[idx + "wk.weight"], hf[idx + "wk.weight_scale_inv"]),
            hf[idx + "weights_proj.weight"],
        ]
    )
    for r in range(2):
        with safe_open(str(out / f"model-rank-{r}-part-0.safetensors"), "pt") as h:
            assert torch.equal(h.get_tensor(idx + "wk_weights_proj.weight"), want)
    code, _, err = run("merge", str(out), str(tmp_path / "hf"))
    assert code == 3 and "dequantised from FP8" in err


def test_fp8_wk_without_whole_blocks_refused(tiny, tmp_path):
    def odd(sd, config):
        for k in [k for k in sd if k.endswith("indexer.wk.weight")]:
            sd[k], sd[k + "_scale_inv"] = quantize_block_fp8(sd[k], (48, 64))  # 128 rows: 3 scale rows

    with pytest.raises(UnsupportedError, match="scaled_dequantize"):
        plan_of(_with(tiny("deepseek-v32"), tmp_path, "odd", odd), tp=2)


def test_layers_without_indexer_refused(tiny, tmp_path):
    src = _with(tiny("glm5"), tmp_path, "freq", lambda sd, c: c.update(index_topk_freq=2))
    with pytest.raises(UnsupportedError, match="index_topk_freq"):
        plan_of(src, tp=2)


# ---- the platform in the manifest and the loader plugin ------------------------------------------


def test_manifest_records_platform_and_plugin_refuses_another(tiny, tmp_path):
    out = tmp_path / "out"
    code, _, err = run("save", str(tiny("deepseek-v32")), str(out), "--tp", "2", "--platform", "cpu")
    assert code == 0, err
    raw = json.loads((out / "reshard.json").read_text())
    assert raw["layout"]["platform"] == "cpu"
    m = read_manifest(out)
    assert m.layout.platform == "cpu"
    lay = m.layout
    engine = checks.Engine(
        layout=Layout(lay.tp, lay.pp, lay.ep, lay.dtype, platform="cuda"), quantization=None, vllm_version="0.32.0"
    )
    problems = checks.engine_problems(m, engine)
    assert problems == [
        "made for vLLM on CPU, this engine runs on CUDA: vLLM's DeepseekV32ForCausalLM class names the weights "
        "differently there (re-save with `reshard save --platform cuda`)"
    ]
    msg = messages.mismatch_message(out, m, engine, problems)  # what the loader raises (ReshardLoadError)
    assert "made for vLLM on CPU, this engine runs on CUDA" in msg and "--platform cuda" in msg
    assert checks.engine_problems(m, replace(engine, layout=engine.layout.but(platform="cpu"))) == []
    # folders of other models record no platform, and load anywhere
    llama = replace(m, layout=m.layout.but(platform=None))
    assert checks.engine_problems(llama, engine) == []


def test_verify_merge_and_reshard_across_platforms(tiny, tmp_path):
    src = tiny("glm5")
    cuda, cpu, hf = tmp_path / "cuda", tmp_path / "cpu", tmp_path / "hf"
    assert run("save", str(src), str(cuda), "--tp", "2")[0] == 0
    assert json.loads((cuda / "reshard.json").read_text())["layout"]["platform"] == "cuda"
    code, _, err = run("verify", str(cuda), "--deep", "--against", str(src))
    assert code == 0, err
    # re-shard a CUDA-named output for CPU, at another TP
    code, _, err = run("save", str(cuda), str(cpu), "--tp", "4", "--platform", "cpu")
    assert code == 0, err
    direct = tmp_path / "direct"
    assert run("save", str(src), str(direct), "--tp", "4", "--platform", "cpu")[0] == 0
    for r in range(4):
        a = load_file(str(cpu / f"model-rank-{r}-part-0.safetensors"))
        b = load_file(str(direct / f"model-rank-{r}-part-0.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, _, err = run("merge", str(cuda), str(hf), "--json")
    assert code == 0, err
    orig, merged = load_file(str(src / "model.safetensors")), {}
    for f in hf.glob("*.safetensors"):
        merged.update(load_file(str(f)))
    mtp = "model.layers.4."  # vLLM's main model skips it: not in the output, so not merged back
    assert set(merged) == {k for k in orig if not k.startswith(mtp)}
    for k, v in merged.items():
        assert v.dtype == orig[k].dtype and torch.equal(v, orig[k]), k


# ---- Qwen3_5MoeForCausalLM (text-only Qwen3.5-MoE) -----------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen35_text_matches_the_vl_class_but_for_prefixes(tiny, tp):
    """The same tiny text model as Qwen3_5MoeForConditionalGeneration's, under model.* / lm_head: vLLM's
    Qwen3_5ForCausalLMBase (no language_model., no tower, so no --language-model-only)."""
    text, vl = plan_of(tiny("qwen3.5-moe-text"), tp=tp), plan_of(tiny("qwen3.5-moe"), tp=tp)
    rename = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}

    def plain(n):
        for a, b in rename.items():
            n = n.replace(a, b, 1) if n.startswith(a) else n
        return n

    assert shapes(text, tp - 1) == {plain(n): v for n, v in shapes(vl, tp - 1).items()}
    assert "--language-model-only" not in text.serve_command("OUT") and text.architecture == "Qwen3_5MoeForCausalLM"
    assert any("mtp." in n for n in text.notes)


def test_qwen35_text_pp_and_merge(tiny, tmp_path):
    src = tiny("qwen3.5-moe-text")
    plan = plan_of(src, tp=1, pp=2)
    first, last = shapes(plan, 0, 0), shapes(plan, 0, 1)
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" in last  # built on every stage
    assert "lm_head.weight" in last and "lm_head.weight" not in first and "model.norm.weight" not in first
    out, hf = tmp_path / "out", tmp_path / "hf"
    assert_streamed_files_equal_plan(src, out, tp=2, ep=True)
    assert run("merge", str(out), str(hf))[0] == 0
    orig = load_file(str(src / "model.safetensors"))
    merged = load_file(str(next(hf.glob("*.safetensors"))))
    assert set(merged) == {k for k in orig if not k.startswith("mtp.")}
    assert all(torch.equal(merged[k], orig[k]) and merged[k].dtype == orig[k].dtype for k in merged)


def test_qwen35_text_with_the_vl_prefix_left_in(tiny, tmp_path):
    """Community text-only exports that keep `model.language_model.` (vLLM's Qwen3_5ForCausalLMBase mapper strips
    it): the same per-rank tensors, read from the prefixed names; merge gives the prefixed names back."""

    def prefixed(sd, config):
        for k in [k for k in sd if k.startswith("model.")]:
            sd["model.language_model." + k.removeprefix("model.")] = sd.pop(k)

    plain = tiny("qwen3.5-moe-text")
    src = _with(plain, tmp_path, "prefixed", prefixed)
    a, b = plan_of(plain, tp=2, ep=True), plan_of(src, tp=2, ep=True)
    assert shapes(a, 1) == shapes(b, 1)
    out, hf = tmp_path / "out", tmp_path / "hf"
    assert_streamed_files_equal_plan(src, out, tp=2)
    assert run("merge", str(out), str(hf))[0] == 0
    orig, merged = load_file(str(src / "model.safetensors")), load_file(str(next(hf.glob("*.safetensors"))))
    assert set(merged) == {k for k in orig if not k.startswith("mtp.")}
    assert all(torch.equal(merged[k], orig[k]) for k in merged)


# ---- Glm4MoeLiteForCausalLM (GLM-4.7-Flash) ------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glm47_flash_is_deepseek_mla_with_glm_moe(tiny, tp):
    plan = plan_of(tiny("glm4.7-flash"), tp=tp)
    s = shapes(plan, tp - 1)
    # DeepSeek's MLA (rules.deepseek): latent projections whole, q_b/kv_b by heads, o_proj by columns
    assert s[L1 + "self_attn.fused_qkv_a_proj.weight"] == ("BF16", (64 + 576, 64))
    assert s[L1 + "self_attn.mla_attn.q_b_proj.weight"] == ("BF16", (4 * 96 // tp, 64))
    assert s[L1 + "self_attn.kv_b_proj.weight"] == ("BF16", (4 * 64 // tp, 512))
    assert s[L1 + "self_attn.mla_attn.o_proj.weight"] == ("BF16", (64, 4 * 32 // tp))
    assert not any("indexer" in n for n in s)
    # GLM-4.5's MoE block: F32 router at mlp.gate, its bias handed to the runner
    assert s[L1 + "mlp.gate.weight"] == ("F32", (8, 64))
    assert s[L1 + "mlp.experts.routed_experts.e_score_correction_bias"] == ("F32", (8,))
    assert "model.layers.0.mlp.gate_up_proj.weight" in s  # layer 0 dense (first_k_dense_replace)
    assert not any(".layers.4." in n for n in s)


def test_glm47_flash_merge(tiny, tmp_path):
    src = tiny("glm4.7-flash")
    out, hf = tmp_path / "out", tmp_path / "hf"
    assert_streamed_files_equal_plan(src, out, tp=2)
    code, _, err = run("merge", str(out), str(hf))
    assert code == 0, err
    orig = load_file(str(src / "model.safetensors"))
    merged = load_file(str(next(hf.glob("*.safetensors"))))
    assert set(merged) == {k for k in orig if not k.startswith("model.layers.4.")}
    assert all(torch.equal(merged[k], orig[k]) and merged[k].dtype == orig[k].dtype for k in merged)
