"""Drive `--load-format reshard` (reshard/vllm_plugin) on real vLLM ranks, without generation.

    load_cases(cases) -> list[list[dict]]   # per case, per rank: {"ok", "error", "mismatch", "loader",
                                            #   "warnings": [(level, message)] the loader logged at WARNING+}

Each case is a dict: ``folder`` (a reshard output), ``tp``, and optionally ``ep``, ``pp``, ``dtype``,
``moe_backend`` (forced as in vllm_state), ``extra`` (``model_loader_extra_config``) and
``compare`` (after a good load, also load the folder, or the folder ``reference`` names, with vLLM's own
ShardedStateLoader into a second model and compare every tensor byte for byte). The engine is built from the folder's config.json with
``load_format="reshard"``, after ``vllm.plugins.load_general_plugins()``: the loader must come from
reshard's ``vllm.general_plugins`` entry point (``registered`` says whether it did). Each rank builds
the model exactly as a vLLM worker does and calls the loader's ``load_weights``; what it raises is
the result. All cases run in one subprocess (one vLLM import), ranks forked as in vllm_state.py.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]


def load_cases(cases: list[dict], *, timeout: float = 900) -> list[list[dict]]:
    with tempfile.TemporaryDirectory(prefix="reshard-plugin-") as tmp:
        spec = {
            "cases": [
                dict(c, folder=str(Path(c["folder"]).resolve()), reference=str(Path(c.get("reference") or c["folder"])))
                for c in cases
            ],
            "out": tmp,
        }
        log = Path(tmp) / "log.txt"
        from tests.against_vllm import textonly, vllm_ipc
        from tests.against_vllm.vllm_state import vllm_env

        env = textonly.env(cases[0]["folder"], vllm_env({"VLLM_LOGGING_LEVEL": "INFO"}))  # torchvision stub
        with open(log, "w") as fh, vllm_ipc.private_ipc_dir(env):
            proc = subprocess.run(
                [sys.executable, str(HERE), "_run", json.dumps(spec)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout,
                cwd=tmp,
            )
        text = log.read_text(errors="replace")
        results = []
        for i, c in enumerate(cases):
            ranks = []
            for r in range(c["tp"] * c.get("pp", 1)):
                f = Path(tmp) / f"case{i}-rank{r}.json"
                ranks.append(
                    json.loads(f.read_text())
                    if f.exists()
                    else {"ok": False, "error": f"no result; log:\n{text[-4000:]}"}
                )
            results.append(ranks)
        if proc.returncode != 0:
            raise RuntimeError(f"plugin load driver failed (rc={proc.returncode}):\n{text[-6000:]}")
        return results


def _rank(rank: int, world: int, port: int, cfg, case: dict, out: Path) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests.against_vllm import vllm_patches, vllm_state

    torch.set_num_threads(1)
    # per case: a case whose ranks were refused leaves its shared memory behind, and ports get reused
    os.environ["VLLM_DIST_IDENT"] = vllm_state.dist_ident(port, f"c{case['_index']}")
    vllm_patches.allow_missing_fp8_linear_kernel(out)
    vllm_patches.force_moe_backend(case.get("moe_backend", "auto"))
    res: dict = {"ok": False, "error": None, "mismatch": [], "warnings": []}
    import logging

    class Keep(logging.Handler):  # what the loader logs at WARNING or above, on this rank
        def emit(self, record: logging.LogRecord) -> None:
            res["warnings"].append((record.levelname, record.getMessage()))

    logging.getLogger("vllm.reshard").addHandler(Keep(logging.WARNING))
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(case["tp"], case.get("pp", 1))

        def build():
            cfg.compilation_config.static_forward_context.clear()
            with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
                return initialize_model(vllm_config=cfg, model_config=cfg.model_config)

        loader = get_model_loader(cfg.load_config)
        res["loader"] = type(loader).__module__ + "." + type(loader).__name__
        try:
            model = build()
            loader.load_weights(model, cfg.model_config)
            res["ok"] = True
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc()[-3000:]
        if res["ok"] and case.get("compare"):
            ref = build()
            ref_config = copy.copy(cfg.model_config)  # the folder sharded_state loads (the reference's)
            ref_config.model = ref_config.model_weights = case["reference"]
            ShardedStateLoader(cfg.load_config.__class__(load_format="sharded_state")).load_weights(ref, ref_config)
            got = ShardedStateLoader._filter_subtensors(model.state_dict())
            want = ShardedStateLoader._filter_subtensors(ref.state_dict())
            if sorted(got) != sorted(want):
                res["mismatch"].append(f"keys differ: {sorted(set(got) ^ set(want))[:5]}")
            for k in sorted(set(got) & set(want)):
                a, b = got[k].detach(), want[k].detach()
                if (
                    a.dtype != b.dtype
                    or a.shape != b.shape
                    or not torch.equal(
                        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
                    )
                ):
                    res["mismatch"].append(f"{k}: differs from sharded_state's load")
            res["compared"] = len(got)
    (out / f"case{case['_index']}-rank{rank}.json").write_text(json.dumps(res))


def _entry(rank, world, port, cfg, case, out):
    try:
        _rank(rank, world, port, cfg, case, out)
    except BaseException:
        (out / f"case{case['_index']}-rank{rank}.json").write_text(
            json.dumps({"ok": False, "error": "driver: " + traceback.format_exc()[-3000:], "mismatch": []})
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(spec_json: str) -> int:
    import multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from vllm.plugins import load_general_plugins

    from tests.against_vllm import vllm_state

    spec = json.loads(spec_json)
    out = Path(spec["out"])
    load_general_plugins()
    registered = _LOAD_FORMAT_TO_MODEL_LOADER.get("reshard")
    print(f"reshard loader registered by entry point: {registered}", flush=True)
    ctx = mp.get_context("fork")
    for i, case in enumerate(spec["cases"]):
        case["_index"] = i
        t0 = time.perf_counter()
        try:
            cfg = EngineArgs(
                model=case["folder"],
                tensor_parallel_size=case["tp"],
                pipeline_parallel_size=case.get("pp", 1),
                enable_expert_parallel=case.get("ep", False),
                dtype=case.get("dtype", "auto"),
                enforce_eager=True,
                max_model_len=64,
                max_num_seqs=1,
                skip_tokenizer_init=True,
                distributed_executor_backend="mp",
                load_format="reshard",
                model_loader_extra_config=case.get("extra") or {},
                moe_backend=case.get("moe_backend", "auto"),
                mm_encoder_tp_mode=case.get("mm_encoder_tp_mode", "weights"),  # issue 27
                language_model_only=case.get("language_model_only", False),
            ).create_engine_config()
        except Exception as e:
            for r in range(case["tp"] * case.get("pp", 1)):
                (out / f"case{i}-rank{r}.json").write_text(
                    json.dumps({"ok": False, "error": f"engine config: {type(e).__name__}: {e}", "mismatch": []})
                )
            continue
        world = case["tp"] * case.get("pp", 1)
        port = vllm_state._free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, cfg, case, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.is_alive():
                p.kill()
        vllm_state.drop_shm(port)
        print(f"case {i} {case['folder']}: {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_run":
        sys.exit(_run(sys.argv[2]))
    print(__doc__)
    sys.exit(2)
