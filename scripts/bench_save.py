"""Sections 1 and 2 of `python -m scripts.bench`: `reshard save` against `cp -r` (and the naive script)
with the page cache dropped and warm, and the peak RSS of `reshard save` by checkpoint size. `_naive`
(the naive script, run in its own process by `python -m scripts.bench _naive`) lives here too."""

from __future__ import annotations

import shutil
from pathlib import Path

from reshard.layout import Layout
from scripts.benchlib import GB, Bench, fmt_b, med, mem_total, run_measured, timed_alone


def compare(b: Bench, ck: dict, tp: int, state: str) -> dict:
    """Section 1 on checkpoint `ck` with the page cache `state` ("dropped" or "warm"): --reps interleaved
    rounds of `reshard save`, `cp -r` and (with --naive, where it fits in memory) the naive script."""
    src = Path(ck["path"])
    out = b.work / "out"
    cmds = {
        "reshard save": b.save_cmd(src, out, tp),
        "cp -r": ["cp", "-r", str(src), str(out)],
    }
    if b.a.naive and ck["bytes"] * 2.5 < mem_total():
        cmds["naive script"] = [b.py, "-m", "scripts.bench", "_naive", str(src), str(out), "--tp", str(tp)]
    elif b.a.naive:
        b.notes.append(f"naive script skipped on {ck['arch']}: it holds the whole checkpoint in memory per rank")
    runs: dict[str, list[dict]] = {k: [] for k in cmds}
    for rep in range(b.a.reps):
        for name, cmd in cmds.items():
            shutil.rmtree(out, ignore_errors=True)
            with timed_alone():
                b.cache.prepare(state, src)
                r = run_measured(cmd, log=b.log)
            runs[name].append(r)
            b.say(
                f"  {ck['arch']} {state} round {rep + 1}: {name} {r['seconds']:.2f} s, CPU {r['cpu']:.2f} s "
                f"(load {r['load']:.1f})"
            )
    shutil.rmtree(out, ignore_errors=True)
    base = runs["reshard save"]
    rows = {}
    for name, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        rows[name] = {
            "seconds": secs,
            "median": med(secs),
            "cpu": med([r["cpu"] for r in rs]),
            "cpu_per_gb": med([r["cpu"] for r in rs]) / (ck["bytes"] / GB),  # every byte is written once
            "rss": max(r["rss"] for r in rs),
            "gbps": ck["bytes"] / med(secs) / GB,
            # per round, reshard's time over this one's: < 1 means reshard is faster
            "reshard_over": med([x["seconds"] / r["seconds"] for x, r in zip(base, rs, strict=True)]),
        }
    return {
        "checkpoint": ck,
        "tp": tp,
        "state": state,
        "rows": rows,
        "commands": {k: b.shown(v) for k, v in cmds.items()},
    }


def rss(b: Bench, ck: dict, tp: int) -> dict:
    """Section 2: one `reshard save` of `ck` from a dropped page cache, with its peak RSS."""
    src, out = Path(ck["path"]), b.work / "out"
    shutil.rmtree(out, ignore_errors=True)
    with timed_alone():
        b.cache.drop([src])
        r = run_measured(b.save_cmd(src, out, tp), log=b.log)
    shutil.rmtree(out, ignore_errors=True)
    b.say(f"  rss {ck['bytes'] / GB:.1f} GB: {fmt_b(r['rss'])} in {r['seconds']:.1f} s")
    return {"checkpoint": ck, "tp": tp, **r}


def cmd_naive(src: Path, out: Path, tp: int) -> None:
    """The obvious script: per rank, load every shard whole, slice with torch, save_file."""
    from safetensors.torch import load_file, save_file

    from reshard.plan import build_plan
    from reshard.sources import open_source
    from tests.fixtures.reference import materialize  # the plan read with torch, whole tensors

    ckpt = open_source(str(src)).checkpoint
    plan = build_plan(ckpt, Layout(tp=tp))
    out.mkdir(parents=True, exist_ok=True)
    for _, files in sorted(plan.ranks().items()):
        source = {}
        for shard in ckpt.files:
            source.update(load_file(src / shard))
        for f in files:
            save_file({t.name: materialize(t, source) for t in f.tensors}, out / f.name, metadata={"format": "pt"})
        del source
