"""Property: whatever is wrong with config.json, the index or a header, reshard answers with a
documented exit code and one line, never exit 1 (a bug) and never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.cli import run

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

CONFIG_KEYS = [
    "architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
    "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings", "torch_dtype", "quantization_config",
    "num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "text_config",
    "attention_bias", "mlp_bias", "num_experts_per_tok",
]  # fmt: skip
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
DOCUMENTED = {0, 2, 3, 4, 5}


@pytest.fixture(scope="module")
def pristine(tiny, tmp_path_factory) -> dict[str, Path]:
    return {"llama": tiny("llama", shards=2), "moe": tiny("qwen3-moe")}


def fresh(src: Path, tmp: Path) -> Path:
    dst = tmp / "src"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def check(src: Path, tmp: Path) -> None:
    for args in (["plan", str(src), "--tp", "2"], ["save", str(src), str(tmp / "out"), "--tp", "2", "--overwrite"]):
        code, _, err = run(*args)
        assert code in DOCUMENTED, f"exit {code}: {err}"
        assert "Traceback" not in err and "internal error" not in err, err
        if code:
            assert err.startswith("reshard: error: ") and err.count("\n") == 1, err


@SETTINGS
@given(key=st.sampled_from(CONFIG_KEYS), value=json_values, which=st.sampled_from(["llama", "moe"]))
def test_any_config_value(pristine, tmp_path_factory, key, value, which):
    tmp = tmp_path_factory.mktemp("cfg")
    src = fresh(pristine[which], tmp)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    check(src, tmp)


@SETTINGS
@given(value=json_values, whole=st.booleans())
def test_any_index(pristine, tmp_path_factory, value, whole):
    tmp = tmp_path_factory.mktemp("idx")
    src = fresh(pristine["llama"], tmp)
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    if whole:
        index = value
    else:
        index["weight_map"][next(iter(index["weight_map"]))] = value
    path.write_text(json.dumps(index))
    check(src, tmp)


@SETTINGS
@given(
    field=st.sampled_from(["dtype", "shape", "data_offsets", None, "__metadata__"]),
    value=json_values,
    pick=st.integers(min_value=0, max_value=10_000),
)
def test_any_header_entry(pristine, tmp_path_factory, field, value, pick):
    tmp = tmp_path_factory.mktemp("hdr")
    src = fresh(pristine["moe"], tmp)
    path = src / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    names = sorted(k for k in head if k != "__metadata__")
    name = names[pick % len(names)]
    if field == "__metadata__":
        head["__metadata__"] = value
    elif field is None:
        head[name] = value
    else:
        head[name] = {**head[name], field: value}
    new = json.dumps(head).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    check(src, tmp)


@SETTINGS
@given(cut=st.integers(min_value=0, max_value=4096))
def test_any_truncation(pristine, tmp_path_factory, cut):
    tmp = tmp_path_factory.mktemp("cut")
    src = fresh(pristine["moe"], tmp)
    path = src / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: max(0, len(raw) - 1 - cut * 97)])
    check(src, tmp)


BAD_VALUES = [0, -1, 2**70, 2.5, "eight", "", [], [1, "x"], {"a": 1}, True, None]
MATRIX_KEYS = [*CONFIG_KEYS, "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "q_lora_rank",
               "moe_layer_freq", "topk_method", "num_nextn_predict_layers", "kv_lora_rank"]  # fmt: skip


@pytest.mark.parametrize("which", ["llama", "moe", "deepseek"])
def test_every_config_key_with_every_kind_of_bad_value(tiny, tmp_path, which):
    """A deterministic matrix beside the random search: each key the planner reads, each wrong type."""
    src = fresh({"llama": tiny("llama"), "moe": tiny("qwen3-moe"), "deepseek": tiny("deepseek-v3")}[which], tmp_path)
    original = json.loads((src / "config.json").read_text())
    bad = []
    for key in MATRIX_KEYS:
        for value in BAD_VALUES:
            (src / "config.json").write_text(json.dumps({**original, key: value}))
            code, _, err = run("plan", str(src), "--tp", "2", "--json")
            if code not in DOCUMENTED or "internal error" in err or (code and err.count("\n") != 1):
                bad.append(f"{key}={value!r}: exit {code}: {err.strip()[:160]}")
    assert not bad, "\n".join(bad)


def test_quantization_config_fields(tiny, tmp_path):
    src = fresh(tiny("qwen3-moe-fp8"), tmp_path)
    original = json.loads((src / "config.json").read_text())
    bad = []
    for key in [
        "quant_method",
        "weight_block_size",
        "activation_scheme",
        "modules_to_not_convert",
        "ignored_layers",
        "config_groups",
        "kv_cache_scheme",
    ]:
        for value in BAD_VALUES:
            qc = {**original["quantization_config"], key: value}
            (src / "config.json").write_text(json.dumps({**original, "quantization_config": qc}))
            code, _, err = run("plan", str(src), "--tp", "2", "--json")
            if code not in DOCUMENTED or "internal error" in err:
                bad.append(f"{key}={value!r}: exit {code}: {err.strip()[:160]}")
    assert not bad, "\n".join(bad)
