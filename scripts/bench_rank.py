"""Section 3 of `python -m scripts.bench`: one rank's load (time and bytes read) from reshard's rank files
against narrowing its tensors out of the original checkpoint. `_load` (one variant, run in its own process
by `python -m scripts.bench _load`) lives here too."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from reshard.layout import Layout
from scripts.benchlib import ROOT, Bench, med, run_measured


def per_rank(b: Bench, ck: dict, tp: int) -> dict:
    """Section 3: rank 0's tensors read three ways (`_load` in its own process, dropped page cache each
    time): from reshard's rank files, and narrowed out of `ck` as vLLM's default loader does or by get_slice."""
    src, out = Path(ck["path"]), b.work / "out-rank"
    shutil.rmtree(out, ignore_errors=True)
    run_measured(b.save_cmd(src, out, tp), log=b.log)
    from reshard.plan import Slice, build_plan
    from reshard.sources import open_source

    ckpt = open_source(str(src)).checkpoint
    plan = build_plan(ckpt, Layout(tp=tp))
    mine = [t for f in plan.files if f.tp_rank == 0 for t in f.tensors]
    need = sum(t.nbytes for t in mine)

    def whole(p: Slice) -> bool:  # a piece that is its whole source tensor: replicated on every rank
        return not p.up and not any(p.start) and tuple(p.stop) == tuple(ckpt.tensors[p.source].shape)

    replicated = sum(
        t.nbytes
        for t in mine
        if any(isinstance(p, Slice) for p in t.pieces) and all(whole(p) for p in t.pieces if isinstance(p, Slice))
    )
    modes = {
        "reshard rank files (safe_open + get_tensor)": ["sharded", str(out)],
        "original, vLLM default loader (get_tensor + narrow)": ["default", str(src)],
        "original, safe_open + get_slice": ["slice", str(src)],
    }
    runs: dict[str, list[dict]] = {k: [] for k in modes}
    for _ in range(max(2, b.a.reps - 1)):
        for name, args in modes.items():
            b.cache.drop([src, out])
            p = subprocess.run(
                [b.py, "-m", "scripts.bench", "_load", *args, "--tp", str(tp), "--rank", "0"],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    shutil.rmtree(out, ignore_errors=True)
    rows = {
        name: {
            "seconds": [r["seconds"] for r in rs],
            "median": med([r["seconds"] for r in rs]),
            "read_bytes": med([r["read_bytes"] for r in rs]),
            "tensor_bytes": rs[0]["tensor_bytes"],
        }
        for name, rs in runs.items()
    }
    b.say("  per-rank: " + ", ".join(f"{k.split(' (')[0]} {v['median']:.2f} s" for k, v in rows.items()))
    return {"checkpoint": ck, "tp": tp, "rank_bytes": need, "replicated_bytes": replicated, "rows": rows}


# -- 4 --


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def cmd_load(mode: str, path: Path, tp: int, rank: int, src: Path | None) -> None:
    """One rank's tensors: from reshard's rank files, or narrowed out of the original checkpoint."""
    import torch  # noqa: F401 - imported before counting: its libraries are reads too
    from safetensors import safe_open

    slices: dict[str, list[tuple]] = {}
    if mode != "sharded":
        from reshard.plan import Slice, build_plan
        from reshard.sources import open_source

        ckpt = open_source(str(path)).checkpoint
        plan = build_plan(ckpt, Layout(tp=tp))
        for f in plan.files:
            if f.tp_rank == rank:
                for t in f.tensors:
                    for p in t.pieces:
                        if isinstance(p, Slice):
                            slices.setdefault(p.source, []).append(
                                tuple(slice(a, b) for a, b in zip(p.start, p.stop, strict=True))
                            )
    r0, t0, tensor_bytes = _read_bytes(), time.perf_counter(), 0
    if mode == "sharded":
        for f in sorted(path.glob(f"model-rank-{rank}-part-*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():  # noqa: SIM118
                    tensor_bytes += h.get_tensor(k).clone().nbytes  # mmap-backed: clone reads it
    else:
        for shard in ckpt.files:  # every rank iterates every shard, as vLLM's default loader
            with safe_open(str(path / shard), "pt") as h:
                for k in h.keys():  # noqa: SIM118
                    if mode == "default":  # safetensors_weights_iterator: get_tensor, then narrow
                        whole = h.get_tensor(k)
                        for idx in slices.get(k, []):
                            tensor_bytes += whole[idx].clone().nbytes
                    else:  # get_slice: read only the rows asked for
                        for idx in slices.get(k, []):
                            tensor_bytes += h.get_slice(k)[idx].clone().nbytes
    print(
        json.dumps(
            {"seconds": time.perf_counter() - t0, "read_bytes": _read_bytes() - r0, "tensor_bytes": tensor_bytes}
        )
    )
