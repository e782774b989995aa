"""Vision towers (issue 27): Qwen2.5-VL's encoder TP-sharded (--mm-encoder-tp-mode weights), whole on every
rank (data) or left out (--language-model-only); the choice recorded, pinned and checked by the plugin.

Byte-for-byte agreement with vLLM itself is tests/against_vllm/test_vllm.py (`# issue 27` block); here the
tower's split against vLLM's QKVParallelLinear / Row / Merged loaders read as formulas, the refusals, the
manifest, merge and re-shard.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from reshard.errors import UnsupportedError
from reshard.layout import Layout
from reshard.manifest import read_manifest
from reshard.merge import merge
from reshard.names import MANIFEST
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.sources import open_source
from reshard.vllm_plugin import checks, messages
from reshard.vllm_plugin.checks import Engine
from tests.fixtures.cli import run
from tests.fixtures.reference import load_source
from tests.fixtures.saving import save
from tests.test_reshard_merge import assert_same, load_dir

B = "visual.blocks.0."


def _rank(folder, r: int) -> dict[str, torch.Tensor]:
    got = {}
    for f in folder.glob(f"model-rank-{r}-part-*.safetensors"):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return got


@pytest.mark.parametrize("tp", [2, 4])
def test_tower_split_as_vllm_loads_it(tiny, tmp_path, tp):
    """qkv fused [q; k; v] over 4 heads of 8: each of q, k, v cut by heads, with its bias; proj and the
    MLP's down by input columns (bias whole); gate_up [gate; up] each split; merger mlp.0 rows, mlp.2
    columns; norms and the Conv3d patch embedding whole."""
    src = tiny("qwen2.5-vl")
    result = save(str(src), tmp_path / "out", tp=tp, max_part_size=DEFAULT_MAX_PART)
    assert result.plan.serve_command("OUT").endswith("--mm-encoder-tp-mode weights --no-mm-device-do-normalize")
    hf = load_source(src, open_source(str(src)).checkpoint)
    qkv, bias = hf[B + "attn.qkv.weight"], hf[B + "attn.qkv.bias"]
    for r in range(tp):
        got = _rank(tmp_path / "out", r)
        want = torch.cat([part.chunk(tp)[r] for part in qkv.chunk(3)])
        assert torch.equal(got[B + "attn.qkv.weight"], want)
        assert torch.equal(got[B + "attn.qkv.bias"], torch.cat([p.chunk(tp)[r] for p in bias.chunk(3)]))
        assert torch.equal(got[B + "attn.proj.weight"], hf[B + "attn.proj.weight"].chunk(tp, dim=1)[r])
        assert torch.equal(got[B + "attn.proj.bias"], hf[B + "attn.proj.bias"])
        gate, up = hf[B + "mlp.gate_proj.weight"], hf[B + "mlp.up_proj.weight"]
        assert torch.equal(got[B + "mlp.gate_up_proj.weight"], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(got[B + "mlp.down_proj.weight"], hf[B + "mlp.down_proj.weight"].chunk(tp, dim=1)[r])
        assert torch.equal(got["visual.merger.mlp.0.weight"], hf["visual.merger.mlp.0.weight"].chunk(tp)[r])
        assert torch.equal(got["visual.merger.mlp.2.weight"], hf["visual.merger.mlp.2.weight"].chunk(tp, dim=1)[r])
        assert torch.equal(got["visual.patch_embed.proj.weight"], hf["visual.patch_embed.proj.weight"])
        assert torch.equal(got[B + "norm1.weight"], hf[B + "norm1.weight"])
        assert "language_model.model.layers.0.self_attn.qkv_proj.weight" in got
        assert "language_model.lm_head.weight" in got


def test_data_mode_whole_tower_on_every_rank(tiny, tmp_path):
    src = tiny("qwen2.5-vl")
    save(str(src), tmp_path / "out", tp=2, mm="data", max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    vision = {k: v for k, v in hf.items() if k.startswith("visual.") and "gate_proj" not in k and "up_proj" not in k}
    for r in range(2):
        got = _rank(tmp_path / "out", r)
        for k, v in vision.items():
            assert torch.equal(got[k], v), k
        assert got[B + "mlp.gate_up_proj.weight"].shape == (128, 32)
        assert got["language_model.model.layers.0.mlp.down_proj.weight"].shape == (64, 64)  # the text model split
    lay = read_manifest(tmp_path / "out").layout
    assert (lay.mm_encoder_tp_mode, lay.language_model_only) == ("data", False)
    raw = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert raw["layout"]["mm_encoder_tp_mode"] == "data" and raw["serve"].endswith(
        "--mm-encoder-tp-mode data --no-mm-device-do-normalize"
    )


def test_serve_line_pins_what_vllm_032_and_033_build_alike(tiny):
    """Qwen-VL towers normalise images on the device by default, and vLLM 0.32 then keeps the norm's
    buffers in the state dict (0.33 does not): pinned off. With --pp, 0.33's Model Runner V2 builds the
    tower on the first stage only (V1 and 0.32: every stage, as the folder holds it): V1 pinned."""
    qwen = open_source(str(tiny("qwen2.5-vl"))).checkpoint
    one = build_plan(qwen, Layout(tp=2)).serve_command("OUT")
    assert one.startswith("vllm serve OUT") and "--no-mm-device-do-normalize" in one
    staged = build_plan(qwen, Layout(tp=2, pp=2)).serve_command("OUT")
    assert staged.startswith("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve OUT --load-format sharded_state")
    text = build_plan(qwen, Layout(tp=2, pp=2, language_model_only=True)).serve_command("OUT")
    assert text.startswith("vllm serve") and "normalize" not in text  # no tower, nothing to pin
    gemma = build_plan(open_source(str(tiny("gemma3-mm"))).checkpoint, Layout(tp=2)).serve_command("OUT")
    assert "normalize" not in gemma  # SigLIP's processor normalises on the host


def test_language_model_only_leaves_the_tower_out(tiny, tmp_path):
    src = tiny("qwen2.5-vl")
    result = save(str(src), tmp_path / "out", tp=2, lm_only=True, max_part_size=DEFAULT_MAX_PART)
    assert not [k for r in range(2) for k in _rank(tmp_path / "out", r) if k.startswith("visual.")]
    assert result.plan.serve_command("OUT").endswith("--language-model-only")
    assert any("under visual. left out" in n for n in result.plan.notes)
    lay = read_manifest(tmp_path / "out").layout
    assert (lay.mm_encoder_tp_mode, lay.language_model_only) == (None, True)
    # merged back, it is a checkpoint without its tower: the note says how vLLM serves it
    code, out, err = run("merge", str(tmp_path / "out"), str(tmp_path / "hf"))
    assert code == 0, err
    assert f"serve it with `vllm serve {tmp_path / 'hf'} --language-model-only`" in " ".join(err.split())  # a note
    code, out, _ = run("merge", str(tmp_path / "out"), str(tmp_path / "hf2"), "--json")
    assert code == 0 and json.loads(out)["language_model_only"] is True


def test_text_only_families_and_text_models_record_it(tiny):
    qwen35 = build_plan(open_source(str(tiny("qwen3.5-moe"))).checkpoint, Layout(tp=2))
    assert (qwen35.layout.mm_encoder_tp_mode, qwen35.layout.language_model_only) == (None, True)
    assert qwen35.serve_command("OUT").count("--language-model-only") == 1
    llama = build_plan(open_source(str(tiny("llama"))).checkpoint, Layout(tp=2))
    assert (llama.layout.mm_encoder_tp_mode, llama.layout.language_model_only) == (None, False)


def test_refusals(tiny):
    src = str(tiny("qwen2.5-vl"))
    code, _, err = run("plan", src, "--tp", "8")  # vision heads 4: weights mode cannot split them
    assert code == 3 and "vision_config.num_heads=4 is not divisible by --tp 8" in err
    assert "--mm-encoder-tp-mode data" in err
    assert run("plan", src, "--tp", "8", "--mm-encoder-tp-mode", "data")[0] == 0
    assert run("plan", src, "--tp", "8", "--language-model-only")[0] == 0
    # both: the folder holds no encoder, and the serve line builds (and drops) it in the mode asked for,
    # the line reshard prints itself where vLLM could not split it (seen in vLLM: qwen2.5-vl TP 2)
    for mode in ("data", "weights"):
        code, out, err = run("plan", src, "--tp", "2", "--language-model-only", "--mm-encoder-tp-mode", mode)
        assert code == 0 and f"--language-model-only --mm-encoder-tp-mode {mode}" in out, err
    code, _, err = run("plan", src, "--tp", "8", "--language-model-only", "--mm-encoder-tp-mode", "weights")
    assert code == 3 and "in the --mm-encoder-tp-mode weights asked for" in err
    assert "use --mm-encoder-tp-mode data, or drop it" in err
    code, _, err = run("plan", str(tiny("llama")), "--tp", "2", "--mm-encoder-tp-mode", "data")
    assert code == 3 and "is a text model" in err


def test_language_model_only_still_builds_the_tower_in_vllm(tiny):
    """vLLM constructs the encoder under --language-model-only too (on the meta device, then dropped:
    `_mark_tower_model`, 0.32 and 0.33), split as --mm-encoder-tp-mode says: vision heads 4 at TP 8 fail
    to split in weights mode (seen in vLLM, tests/against_vllm), so the serve line asks for data mode,
    which builds it whole; Gemma-3 has no data mode: refused. The folder itself is the text model either way."""
    qwen = open_source(str(tiny("qwen2.5-vl"))).checkpoint
    eight = build_plan(qwen, Layout(tp=8, language_model_only=True))
    assert eight.serve_command("OUT").endswith("--language-model-only --mm-encoder-tp-mode data")
    assert any("builds the vision encoder even with --language-model-only" in n for n in eight.notes)
    assert (eight.layout.mm_encoder_tp_mode, eight.layout.language_model_only) == (None, True)
    assert not [t for f in eight.files for t in f.tensors if t.name.startswith("visual.")]
    assert (
        build_plan(qwen, Layout(tp=4, language_model_only=True)).serve_command("OUT").endswith("--language-model-only")
    )
    llama4 = build_plan(open_source(str(tiny("llama4"))).checkpoint, Layout(tp=8))  # text-only by default
    assert llama4.serve_command("OUT").endswith("--language-model-only --mm-encoder-tp-mode data")
    code, _, err = run("plan", str(tiny("gemma3-mm")), "--tp", "8", "--language-model-only")
    assert code == 3 and "even with --language-model-only" in err and "no --mm-encoder-tp-mode data" in err


def test_an_encoder_size_tp_does_not_divide(tiny):
    """Heads are not the only split: a vision MLP width TP does not divide (Qwen2.5-VL's 3420 at TP 8; 34 at
    TP 4 here) makes vLLM fail to build the encoder in weights mode, with the tower or without it: refused
    saying data mode would do, and pinned to data mode under --language-model-only (seen in vLLM)."""
    ckpt = open_source(str(tiny("qwen2.5-vl-i34"))).checkpoint
    with pytest.raises(
        UnsupportedError, match=r"= 34 is not divisible by --tp 4 \(vLLM's --mm-encoder-tp-mode weights"
    ) as e:
        build_plan(ckpt, Layout(tp=4))
    assert "use --mm-encoder-tp-mode data" in str(e.value)
    text = build_plan(ckpt, Layout(tp=4, language_model_only=True))
    assert text.serve_command("OUT").endswith("--language-model-only --mm-encoder-tp-mode data")
    assert any("= 34 is not divisible by --tp 4: vLLM builds the vision encoder" in n for n in text.notes)
    assert build_plan(ckpt, Layout(tp=2, language_model_only=True)).serve_command("OUT").endswith("-only")
    assert build_plan(ckpt, Layout(tp=4, mm_encoder_tp_mode="data")).layout.mm_encoder_tp_mode == "data"


def test_language_model_only_without_vision_config_plans_as_before(tiny, tmp_path):
    """A text-only export that dropped vision_config: its encoder's heads are unknown (vLLM takes its config
    class's defaults), so nothing is pinned and nothing refused."""
    src = tmp_path / "novis"
    shutil.copytree(tiny("qwen2.5-vl"), src)
    config = json.loads((src / "config.json").read_text())
    del config["vision_config"]
    (src / "config.json").write_text(json.dumps(config))
    plan = build_plan(open_source(str(src)).checkpoint, Layout(tp=8, language_model_only=True))
    assert plan.serve_command("OUT").endswith("--language-model-only")


def test_tp_above_the_experts_is_refused_as_vllm_does(tiny):
    """vLLM's Qwen3MoeSparseMoeBlock (Qwen3-VL-MoE's text model) refuses a TP size above the number of experts."""
    code, _, err = run("plan", str(tiny("qwen3-vl-moe")), "--tp", "8", "--language-model-only")  # 4 experts
    assert code == 3 and "--tp 8 is greater than the number of experts 4" in err
    code, _, err = run("plan", str(tiny("llama4")), "--tp", "8", "--ep")  # 4 experts, fused: a rank would hold none
    assert code == 3 and "Llama4ForConditionalGeneration's 4 experts do not divide among --tp 8 ranks" in err


def test_qwen35_text_only_by_default_tower_when_asked(tiny):
    ckpt = open_source(str(tiny("qwen3.5-moe"))).checkpoint
    text = build_plan(ckpt, Layout(tp=2))
    assert text.serve_command("OUT").endswith("--language-model-only")
    assert any("under model.visual. left out" in n for n in text.notes)
    tower = build_plan(ckpt, Layout(tp=2, mm_encoder_tp_mode="weights"))
    assert tower.serve_command("OUT").endswith("--mm-encoder-tp-mode weights --no-mm-device-do-normalize")
    assert not any("model.visual." in n for n in tower.notes)
    names = {t.name: t.shape for f in tower.files if f.tp_rank == 1 for t in f.tensors}
    assert names["visual.blocks.0.attn.qkv.weight"] == (48, 32)
    assert names["visual.pos_embed.weight"] == (64, 32)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4, mm="data")])
def test_merge_round_trips_byte_identical(tiny, tmp_path, layout):
    src = tiny("qwen2.5-vl")
    save(str(src), tmp_path / "out", max_part_size=DEFAULT_MAX_PART, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf", max_shard_size=400_000)
    assert result["not_in_output"] == []
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))


def test_reshard_an_output(tiny, tmp_path):
    src = tiny("qwen2.5-vl")
    save(str(src), tmp_path / "first", tp=2, max_part_size=DEFAULT_MAX_PART)
    save(str(tmp_path / "first"), tmp_path / "via", tp=4, mm="data", max_part_size=DEFAULT_MAX_PART)
    save(str(src), tmp_path / "direct", tp=4, mm="data", max_part_size=DEFAULT_MAX_PART)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))


def test_reshard_of_a_language_model_only_output_to_the_tower_is_refused(tiny, tmp_path):
    save(str(tiny("qwen2.5-vl")), tmp_path / "first", tp=2, lm_only=True, max_part_size=DEFAULT_MAX_PART)
    code, _, err = run("save", str(tmp_path / "first"), str(tmp_path / "via"), "--tp", "2")
    assert code == 4 and "holds no tensor of Qwen2_5_VLForConditionalGeneration's vision tower" in err
    assert "pass --language-model-only" in err and "--mm-encoder-tp-mode data" not in err  # data mode would not help
    assert run("save", str(tmp_path / "first"), str(tmp_path / "via"), "--tp", "4", "--language-model-only")[0] == 0


def test_plugin_refuses_another_encoder_layout(tiny, tmp_path):
    save(str(tiny("qwen2.5-vl")), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    m = read_manifest(tmp_path / "out")
    weights = Layout(tp=2, dtype="bfloat16", mm_encoder_tp_mode="weights")
    engine = Engine(weights, quantization=None, vllm_version="0.32.0")
    assert checks.engine_problems(m, engine) == []
    data = replace(engine, layout=weights.but(mm_encoder_tp_mode="data"))
    problems = checks.engine_problems(m, data)
    assert problems == [
        "made for --mm-encoder-tp-mode weights (the vision tower TP-sharded), this engine runs --mm-encoder-tp-mode data"
    ]
    message = messages.mismatch_message(tmp_path / "out", m, data, problems)
    assert "--mm-encoder-tp-mode data`" in message  # the save line for this engine
    text = replace(engine, layout=weights.but(mm_encoder_tp_mode=None, language_model_only=True))
    assert checks.engine_problems(m, text) == [
        "made with the vision tower (--mm-encoder-tp-mode weights), this engine runs --language-model-only "
        "and would not load it"
    ]
    lm = replace(m, layout=m.layout.but(mm_encoder_tp_mode=None, language_model_only=True))
    assert checks.engine_problems(lm, text) == []
    assert checks.engine_problems(lm, engine) == [
        "made --language-model-only (the files hold no vision tower), this engine builds the vision tower "
        "(--mm-encoder-tp-mode weights)"
    ]
    old = replace(m, layout=m.layout.but(mm_encoder_tp_mode=None))  # written before issue 27: not checked
    assert checks.engine_problems(old, text) == []


@pytest.mark.parametrize("arch", ["qwen3-vl", "qwen3-vl-moe", "gemma3-mm"])
def test_other_towers_merge_back_or_say_why(tiny, tmp_path, arch):
    """Qwen3-VL and Gemma-3 merge back byte-identical; Qwen3-VL-MoE's experts are written transposed
    (vLLM's layout of the releases' [E, in, out]), refused as Llama-4's are."""
    src = tiny(arch)
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    code, _, err = run("merge", str(tmp_path / "out"), str(tmp_path / "hf"))
    if arch == "qwen3-vl-moe":
        assert code == 3 and "mlp.experts.down_proj transposed" in err
        return
    assert code == 0, err
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))


def test_gemma3_has_no_data_mode_and_its_projector_is_whole(tiny, tmp_path):
    src = str(tiny("gemma3-mm"))
    code, _, err = run("plan", src, "--tp", "2", "--mm-encoder-tp-mode", "data")
    assert code == 3 and "does not support it and falls back to weights" in err
    save(src, tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(tiny("gemma3-mm"), open_source(src).checkpoint)
    proj = "multi_modal_projector.mm_input_projection_weight"
    for r in range(2):
        got = _rank(tmp_path / "out", r)
        assert torch.equal(got[proj], hf[proj])
        q = hf["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(
            got["vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight"][:16], q.chunk(2)[r]
        )


def test_qwen3_vl_deepstack_mergers_split(tiny, tmp_path):
    src = tiny("qwen3-vl")
    save(str(src), tmp_path / "out", tp=4, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    d = "deepstack_merger_list.0."
    for r in range(4):
        got = _rank(tmp_path / "out", r)
        assert torch.equal(
            got["visual." + d + "linear_fc1.weight"], hf["model.visual." + d + "linear_fc1.weight"].chunk(4)[r]
        )
        assert torch.equal(got["visual." + d + "linear_fc2.bias"], hf["model.visual." + d + "linear_fc2.bias"])
        assert torch.equal(got["visual.pos_embed.weight"], hf["model.visual.pos_embed.weight"])
        assert torch.equal(got["visual.blocks.1.norm2.bias"], hf["model.visual.blocks.1.norm2.bias"])


def test_llama4_tower_when_asked_projector_split_in_both_modes(tiny, tmp_path):
    src = tiny("llama4")
    ckpt = open_source(str(src)).checkpoint
    assert build_plan(ckpt, Layout(tp=2)).layout.language_model_only
    save(str(src), tmp_path / "w", tp=2, mm="weights", max_part_size=DEFAULT_MAX_PART)
    save(str(src), tmp_path / "d", tp=2, mm="data", max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, ckpt)
    layer = "vision_model.model.layers.0.self_attn."
    qkv = torch.cat([hf[layer + p + "_proj.weight"] for p in "qkv"])
    proj = "multi_modal_projector.linear_1.weight"
    for r in range(2):
        w, d = _rank(tmp_path / "w", r), _rank(tmp_path / "d", r)
        assert torch.equal(w[proj], hf[proj].chunk(2)[r]) and torch.equal(d[proj], hf[proj].chunk(2)[r])
        assert torch.equal(d[layer + "qkv_proj.weight"], qkv)
        assert torch.equal(w[layer + "qkv_proj.weight"], torch.cat([t.chunk(2)[r] for t in qkv.chunk(3)]))
        assert torch.equal(w["vision_model.class_embedding"], hf["vision_model.class_embedding"])


def test_verify_deep_against_the_source(tiny, tmp_path):
    src = tiny("qwen2.5-vl")
    save(str(src), tmp_path / "out", tp=2, mm="data", max_part_size=DEFAULT_MAX_PART)
    code, out, err = run("verify", str(tmp_path / "out"), "--against", str(src), "--deep")
    assert code == 0, out + err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mm_encoder_tp_mode", "pipeline", "mm_encoder_tp_mode must be weights, data or null"),
        ("mm_encoder_tp_mode", 1, "layout.mm_encoder_tp_mode is 1"),
        ("language_model_only", "yes", "layout.language_model_only is 'yes'"),
    ],
)
def test_manifest_refuses_a_bad_encoder_layout(tiny, tmp_path, key, value, message):
    save(str(tiny("qwen2.5-vl")), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    path = tmp_path / "out" / MANIFEST
    obj = json.loads(path.read_text())
    obj["layout"][key] = value
    path.write_text(json.dumps(obj))
    code, out, err = run("verify", str(tmp_path / "out"))
    assert code == 7 and message in out + err, (code, out + err)


def test_a_quantized_tower_is_refused(tiny, tmp_path):
    """Quantization tools that convert every 2-D weight also convert the tower; its quantized vLLM layout
    is not checked, so only the text model is written (--language-model-only)."""
    from tests.fixtures.quant import convert

    src = convert(tiny("qwen2.5-vl"), tmp_path / "fp8", "ct-channel")
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 3 and "visual.merger.mlp.0: the checkpoint's compressed-tensors quantization applies" in err
    assert "pass --language-model-only" in err and "--mm-encoder-tp-mode data" not in err  # data mode would not help
    code, out, _ = run("plan", str(src), "--tp", "2", "--language-model-only")
    assert code == 0 and "--mm-encoder-tp-mode" not in out  # the left-out tower's quantization pins nothing
