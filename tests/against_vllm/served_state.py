"""The *served* model, compared between two loaders: everything a vLLM worker holds after ``load_model``.

    served_state(hf_dir, sharded_dir, tp, dump_dir) -> list[str]     # [] == identical

On ``tp`` forked gloo ranks (as vllm_state.py), each rank runs vLLM's own ``BaseModelLoader.load_model``
twice -- the default loader on ``hf_dir`` and ``ShardedStateLoader`` on ``sharded_dir`` (built from
``sharded_dir``'s config.json) -- i.e. weight loading *and* ``process_weights_after_loading`` (MLA's
W_UK_T/W_UV, CPU GEMM packing, FP8 post-processing), then records every tensor the model can reach:
parameters, buffers (persistent or not: rotary cos_sin_cache, ...), tensor attributes of modules and
of their attention ``impl`` objects, and their plain scalar attributes (scales, flags).  The two
records must be equal byte for byte; each difference is returned as one line.

Generation compares tokens; this compares the model the tokens come from, so a difference in
loader-dependent state shows up even when it does not flip a token on a tiny model.

CLI: ``python tests/against_vllm/served_state.py HF_DIR SHARDED_DIR --tp T [--load-format F] [--keep DIR]``
(``--load-format``: another loader for SHARDED_DIR, e.g. a plugin's; the default loader stays the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.against_vllm import vllm_ipc, vllm_state  # noqa: E402

_SCALARS = (bool, int, float, str, type(None))
# plain (non-Module) objects whose attributes take part in the forward: attention impls, quant methods
_OBJECTS = ("impl", "quant_method", "kernel", "fp8_linear", "rotary_emb")


def _collect(model) -> tuple[dict, dict]:
    """(tensors, scalars) reachable from model, keyed by dotted path; aliases recorded once per path."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}

    def visit(prefix: str, obj, depth: int) -> None:
        d = vars(obj)
        for k, v in d.get("_parameters", {}).items():
            if v is not None:
                tensors[f"{prefix}{k}"] = v.detach()
        for k, v in d.get("_buffers", {}).items():
            if v is not None:
                tensors[f"{prefix}{k}"] = v.detach()
        for k, v in d.items():
            if k.startswith("__") or k in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}{k}"] = v.detach()
            elif isinstance(v, _SCALARS):
                scalars[f"{prefix}{k}"] = repr(v)
            elif isinstance(v, torch.dtype):
                scalars[f"{prefix}{k}"] = str(v)
            elif depth < 2 and k in _OBJECTS and not isinstance(v, torch.nn.Module) and hasattr(v, "__dict__"):
                visit(f"{prefix}{k}.", v, depth + 1)

    for name, mod in model.named_modules(remove_duplicate=False):
        visit(f"{name}." if name else "", mod, 0)
    return tensors, scalars


def _rank_main(rank: int, world: int, port: int, cfgs: dict, dump_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does at import
    if os.environ.get("RESHARD_FAKE_AMX") == "1":
        # experiment only: let a CPU without AMX pick the AMX code paths (FP8 kernels, AMX_MLA) for
        # their post-processing; running them would need real AMX
        torch.cpu._is_amx_tile_supported = lambda: True
    if os.environ.get("RESHARD_FP8_STANDIN") == "1":
        # experiment only, CPUs without vLLM's FP8 kernels: FP8 GEMM kernels become a stand-in whose
        # post-processing leaves the checkpoint layout alone (vLLM's MLA W_UK_T/W_UV still dequantize
        # kv_b_proj with their own code); running the model is impossible then
        from vllm.model_executor.layers.quantization import fp8

        class _Standin:
            def process_weights_after_loading(self, layer):
                pass

        fp8.init_fp8_linear_kernel = lambda *a, **k: _Standin()
        # and FP8 MoE (no CPU backend without AMX): experts stay as loaded
        fp8.Fp8MoEMethod.process_weights_after_loading = lambda self, layer: None
    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = vllm_state.dist_ident(port)
    first = next(iter(cfgs.values()))
    with set_current_vllm_config(first):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(world, 1)
    for tag, cfg in cfgs.items():
        cfg.compilation_config.static_forward_context.clear()
        rotary_embedding._ROPE_DICT.clear()  # a fresh rotary embedding per model, as in a fresh worker
        with set_current_vllm_config(cfg):
            model = get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        tensors, scalars = _collect(model)
        out = {}
        for k, t in tensors.items():
            t = t.contiguous() if t.numel() else t
            out[k] = t.clone() if t.numel() else torch.zeros(0, dtype=t.dtype)
        # safetensors refuses shared storage: clone above; record shapes of empties in the scalars
        save_file(out, str(Path(dump_dir) / f"{tag}-rank{rank}.safetensors"))
        (Path(dump_dir) / f"{tag}-rank{rank}.json").write_text(json.dumps(scalars, indent=0, sort_keys=True))
        del model


def _rank_entry(rank, world, port, cfgs, dump_dir):
    import traceback

    try:
        _rank_main(rank, world, port, cfgs, dump_dir)
    except BaseException:
        err = traceback.format_exc()
        sys.stderr.write(f"[rank {rank}] {err}\n")
        Path(dump_dir, f"error-rank{rank}.txt").write_text(err)
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


def _dump_main(spec_json: str) -> int:
    import multiprocessing as mp

    spec = json.loads(spec_json)
    for k, v in vllm_state.VLLM_ENV.items():
        os.environ.setdefault(k, v)
    case = dict(tp=spec["tp"], pp=1, ep=False, dtype=spec.get("dtype", "auto"))
    cfgs = {
        "default": vllm_state._make_config(spec["hf_dir"], case),
        # recorded as "sharded_state" whatever the format (e.g. a loader plugin's), see compare()
        "sharded_state": vllm_state._make_config(
            spec["sharded_dir"], case, load_format=spec.get("load_format", "sharded_state")
        ),
    }
    port = vllm_state._free_port()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_rank_entry, args=(r, spec["tp"], port, cfgs, spec["dump_dir"])) for r in range(spec["tp"])
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    vllm_state.drop_shm(port)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def compare(dump_dir: str | os.PathLike, tp: int, a: str = "default", b: str = "sharded_state") -> list[str]:
    """Differences between loader ``a``'s and loader ``b``'s record, rank by rank; [] == identical."""
    problems = []
    for r in range(tp):
        problems += [f"[rank {r}] {p}" for p in compare_records(dump_dir, f"{a}-rank{r}", f"{b}-rank{r}")]
    return problems


def compare_records(dump_dir: str | os.PathLike, a: str, b: str) -> list[str]:
    """Differences between two records (``<name>.safetensors`` + ``<name>.json``) in dump_dir."""
    from safetensors.torch import load_file

    d = Path(dump_dir)
    ta, tb = load_file(str(d / f"{a}.safetensors")), load_file(str(d / f"{b}.safetensors"))
    sa, sb = json.loads((d / f"{a}.json").read_text()), json.loads((d / f"{b}.json").read_text())
    problems = [f"tensor {k}: only in {a if k in ta else b}" for k in sorted(set(ta) ^ set(tb))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"tensor {k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not vllm_state._bytes_equal(x, y):
            problems.append(vllm_state._describe_value_diff(k, x, y))
    for k in sorted(set(sa) | set(sb)):
        if sa.get(k) != sb.get(k):
            problems.append(f"attribute {k}: {a} {sa.get(k)} vs {b} {sb.get(k)}")
    return problems


def served_state(
    hf_dir,
    sharded_dir,
    tp: int,
    dump_dir,
    *,
    dtype: str = "auto",
    load_format: str = "sharded_state",
    timeout: float = 900,
) -> list[str]:
    """Served state of the default loader on hf_dir vs ``load_format`` on sharded_dir; [] == identical."""
    import subprocess

    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    spec = dict(hf_dir=str(Path(hf_dir).resolve()), sharded_dir=str(Path(sharded_dir).resolve()), tp=tp)
    spec.update(dump_dir=str(Path(dump_dir).resolve()), dtype=dtype, load_format=load_format)
    log = Path(dump_dir) / "served-state.log"
    env = vllm_state.vllm_env()
    with open(log, "w") as fh, vllm_ipc.private_ipc_dir(env):
        proc = subprocess.run(
            [sys.executable, str(HERE), "_dump", json.dumps(spec)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"served-state dump failed (rc={proc.returncode}); log {log}:\n{log.read_text()[-6000:]}")
    return compare(dump_dir, tp)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_dump":
        return _dump_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("sharded_dir", type=Path)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--keep", type=Path, help="keep the records here")
    ap.add_argument("--load-format", default="sharded_state", help="the loader for SHARDED_DIR (a plugin's)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="served-") as tmp:
        t0 = time.perf_counter()
        problems = served_state(a.hf_dir, a.sharded_dir, a.tp, a.keep or tmp, load_format=a.load_format)
    for p in problems:
        print(p)
    print(f"{len(problems)} difference(s)" if problems else "identical", f"({time.perf_counter() - t0:.0f}s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
