"""Does vLLM's sharded_state of vLLM's *own* state dict generate what the default loader does? (issue 12 §4)

    python tests/against_vllm/mla_repro.py WORK_DIR --arch deepseek-v3 --tp 2 [--variant yarn] [...]

Builds a tiny checkpoint (tests/fixtures/tiny.py), optionally rewrites its config.json with the keys
of a real DeepSeek release (``--variant``), lets vLLM load it with its default loader and save its
own pre-processing state with ``ShardedStateLoader.save_model`` (vllm_state.dump_expected, save_dir),
then generates greedily from the HF folder (default loader) and from vLLM's own files
(``load_format="sharded_state"``) and prints both token lists.  reshard is not involved.
Needs .venv-vllm; wrap in /work/tools/vllm-slot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.against_vllm import generate, vllm_state  # noqa: E402
from tests.fixtures import tiny  # noqa: E402
from tests.fixtures.tiny import make_tiny  # noqa: E402

# config.json keys of the real releases (DeepSeek-V3 / R1 and V2-Lite), layered over the tiny config.
YARN_V3 = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
YARN_V2_LITE = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707)
VARIANTS: dict[str, dict] = {
    "plain": {},  # the fixture's own config.json (DeepSeek fixtures carry yarn since issue 12)
    # rope_scaling yarn as in DeepSeek-V3/R1 (mscale 1.0) and V2-Lite (0.707)
    "yarn": {"rope_scaling": YARN_V3, "max_position_embeddings": 163840},
    "yarn-v2": {"rope_scaling": YARN_V2_LITE, "max_position_embeddings": 163840},
    "yarn-small": {"rope_scaling": dict(YARN_V3, original_max_position_embeddings=64), "max_position_embeddings": 2560},
}
# Model sizes closer to DeepSeek-V3 (tiny's own config is overridden with these; --arch-config)
V3_SHAPE = dict(
    hidden_size=256,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_hidden_layers=5,
    n_routed_experts=32,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    q_lora_rank=128,
    qk_nope_head_dim=128,
    v_head_dim=128,
)
SHAPES = {"tiny": {}, "v3": V3_SHAPE}


def rewrite_config(src: Path, extra: dict) -> None:
    cfg = json.loads((src / "config.json").read_text())
    if "rope_scaling" in extra:
        rope = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg.update(extra)
    (src / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--arch", default="deepseek-v3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--variant", default="plain", choices=list(VARIANTS))
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES), help="model sizes (tiny's or closer to V3)")
    ap.add_argument("--config", default="{}", help="extra config.json keys (JSON)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reuse", action="store_true", help="keep WORK/src and WORK/saved if present")
    ap.add_argument(
        "--runs",
        default="default,sharded_state",
        help="engines in order, comma-separated: default|sharded_state; '/' starts a new process",
    )
    a = ap.parse_args(argv)
    src, saved, dump = a.work / "src", a.work / "saved", a.work / "dump"
    t0 = time.perf_counter()
    if not (a.reuse and (src / "config.json").exists()):
        arch = a.arch
        if SHAPES[a.shape]:
            base = tiny.ARCHS[a.arch]
            arch = f"{a.arch}-{a.shape}"
            tiny.ARCHS[arch] = dataclasses.replace(base, config={**base.config, **SHAPES[a.shape]})
        make_tiny(arch, src)
        rewrite_config(src, {**VARIANTS[a.variant], **json.loads(a.config)})
    if not (a.reuse and any(saved.glob("model-rank-*.safetensors"))):
        vllm_state.dump_expected(src, dump, a.tp, save_dir=saved, load_dir=saved)
        probs = vllm_state.loader_problems(dump, a.tp)
        print("load check of vLLM's own files:", probs or "identical after ShardedStateLoader.load_weights")
    results: list[tuple[str, list]] = []
    for group in a.runs.split("/"):
        names = group.split(",")
        runs = [dict(model_dir=src) if n == "default" else dict(model_dir=saved, load_format=n) for n in names]
        toks = generate.greedy_tokens_many(runs, a.tp, max_tokens=a.max_tokens)
        results += list(zip(names, toks, strict=True))
    for i, (name, toks) in enumerate(results):
        print(
            json.dumps(
                {
                    "arch": a.arch,
                    "shape": a.shape,
                    "tp": a.tp,
                    "variant": a.variant,
                    "run": i,
                    "loader": name,
                    "tokens": toks,
                }
            )
        )
    same = all(t == results[0][1] for _, t in results)
    print("EQUAL" if same else "DIFFERENT", f"({time.perf_counter() - t0:.0f}s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
