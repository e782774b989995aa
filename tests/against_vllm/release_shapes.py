"""Record what vLLM 0.32 builds for the header-only releases of tests/fixtures/releases (issue 15).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=$PWD \
        /work/tools/vllm-slot .venv-vllm/bin/python tests/against_vllm/release_shapes.py [RELEASE ...]

For each release of tests/fixtures/releases (GLM-4.6, MiniMax-M2, Kimi-K2) and of
tests/fixtures/qwen_next_releases.py (Qwen3-Next-80B-A3B, Qwen3.5-397B-A17B-FP8: 3 gated-delta-net
layers and 1 full-attention layer; Qwen3.5 with --language-model-only and the torchvision stub): its
published config.json with the decoder layers cut to a few (`CUT_LAYERS`), built by vLLM's own model code on 8 gloo CPU ranks, with and without
expert parallelism, exactly as `vllm_state.py` builds a model before loading (`initialize_model`
under the vLLM config and the model dtype). No weight is loaded: parameters are allocated, never
touched, so the 300-700B models' layers cost virtual memory only. Each rank's
`ShardedStateLoader._filter_subtensors(model.state_dict())` -- names, dtypes, shapes -- is what
`--load-format sharded_state` requires of that rank's files. Written beside the release's
registry (tests/fixtures/releases/<release>.json, tests/fixtures/qwen_next_releases/<release>.json);
tests/test_releases.py and tests/test_qwen_next.py plan the header-only copies and compare. Nothing in the JSON comes from reshard.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE / "stubs"))  # torchvision, for vLLM's Qwen3.5 code (stubs/torchvision)

import tests.fixtures.llama4_releases as llama4_releases  # noqa: E402
from tests.against_vllm import vllm_ipc, vllm_patches, vllm_state  # noqa: E402
from tests.fixtures import dsa_releases, fp4_releases, qwen_next_releases, releases, vision_releases  # noqa: E402
from tests.fixtures.tiny import _write_tokenizer  # noqa: E402

# each: RELEASES, CUT_LAYERS, cut(), HERE (where the JSON goes); optional side_files(), MOE_BACKEND (issue 26),
# DENSE (releases without experts: no EP layout, issue 27), LAYOUTS (the layouts to record when not TP 8 +- EP)
REGISTRIES = (releases, qwen_next_releases, fp4_releases, dsa_releases, vision_releases)
REGISTRIES += (llama4_releases,)  # issue 27: Llama-4-Maverick, text-only and with its tower in both modes
_MOE_BACKEND = ["auto"]  # the release's --moe-backend, set before the ranks fork

TP = 8


def _rank(rank: int, port: int, vllm_config, out: Path) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = vllm_state.dist_ident(port)
    vllm_patches.allow_missing_fp8_linear_kernel(out)
    vllm_patches.force_moe_backend(_MOE_BACKEND[0])
    vllm_patches.allow_nvfp4(_MOE_BACKEND[0])  # issue 26: NVFP4 kernel/backend selection only
    vllm_patches.allow_wna16_moe()  # Kimi-K2-Thinking's INT4 experts: no WNA16 MoE backend on CPU (selection only)
    vllm_patches.allow_sparse_mla_build()  # issue 27: DSA releases
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=TP, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
        )
        ensure_model_parallel_initialized(TP, 1)
        vllm_config.compilation_config.static_forward_context.clear()
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        info = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in sorted(state.items())}
    (out / f"rank{rank}.json").write_text(json.dumps(info))


def _entry(*args) -> None:
    import traceback

    try:
        _rank(*args)
    except BaseException:
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def record(release: str) -> dict:
    import multiprocessing as mp

    reg = _registry(release)
    config = reg.cut(reg.RELEASES[release], reg.CUT_LAYERS[release])
    result = {"release": release, "num_hidden_layers": reg.CUT_LAYERS[release], "tp": TP, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix=f"release-{release}-") as tmp:
        model_dir = Path(tmp, "model")
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        _write_tokenizer(model_dir, 1000)  # Qwen3.5's model __init__ asks for a tokenizer; ids never used
        for name, text in (reg.side_files(release, config) if hasattr(reg, "side_files") else {}).items():
            (model_dir / name).write_text(text)  # hf_quant_config.json
        _MOE_BACKEND[0] = getattr(reg, "MOE_BACKEND", {}).get(release, "auto")
        for layout, keys in _layouts(reg, release).items():
            t0 = time.perf_counter()
            case = {"tp": TP, "pp": 1, "dtype": "auto", "moe_backend": _MOE_BACKEND[0], **keys}
            vllm_config = vllm_state._make_config(str(model_dir), case, load_format="dummy")
            out = Path(tmp, layout)
            out.mkdir()
            port = vllm_state._free_port()
            ctx = mp.get_context("fork")
            procs = [ctx.Process(target=_entry, args=(r, port, vllm_config, out)) for r in range(TP)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(900)
            vllm_state.drop_shm(port)
            if any(p.exitcode != 0 for p in procs):
                raise SystemExit(f"{release} {layout}: ranks exited {[p.exitcode for p in procs]}")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)]
            states = list({json.dumps(s, sort_keys=True): s for s in ranks}.values())
            result["layouts"][layout] = {
                "states": states,
                "rank_state": [states.index(s) for s in ranks],
            }
            print(f"{release} {layout}: {len(ranks[0])} keys per rank, {time.perf_counter() - t0:.0f} s", flush=True)
    if reg is qwen_next_releases:  # its test checks the padded vocabulary against this
        result["vocab_size"] = config.get("text_config", config)["vocab_size"]
    return result


def _layouts(reg, release: str) -> dict[str, dict]:
    """Layout name -> the vLLM case keys of each layout recorded: the registry's LAYOUTS where it names them,
    else TP 8 and TP 8 + EP (TP 8 alone for DENSE releases: vLLM refuses EP for a model without experts)."""
    if release in getattr(reg, "LAYOUTS", {}):
        return reg.LAYOUTS[release]
    return {"tp8": {"ep": False}} | ({} if release in getattr(reg, "DENSE", ()) else {"tp8-ep": {"ep": True}})


def _registry(release: str):
    for reg in REGISTRIES:
        if release in reg.RELEASES:
            return reg
    raise SystemExit(f"unknown release {release!r}: one of {[r for reg in REGISTRIES for r in reg.RELEASES]}")


def main(argv: list[str]) -> int:
    for k, v in vllm_state.VLLM_ENV.items():
        os.environ.setdefault(k, v)
    import vllm

    with vllm_ipc.private_ipc_dir(os.environ):  # the forked ranks' sockets
        for release in argv or [r for reg in REGISTRIES for r in reg.RELEASES]:
            res = record(release)
            res["vllm"] = vllm.__version__
            where = _registry(release).HERE
            where.mkdir(exist_ok=True)
            (where / f"{release}.json").write_text(json.dumps(res, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
