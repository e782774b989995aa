"""`save REPO --stream` of an MoE from a local Hub server, with and without the spill (RESHARD_STREAM_SPILL).

    python -m scripts.bench_stream [--layers 4] [--shard-size 600MB] [--tp 8] [--reps 2] [--work DIR]
    python -m scripts.bench_stream --torchrun 2 [--ep] [--baseline OLD_TREE] ...

A synthetic Qwen3-30B-A3B-shaped checkpoint (scripts/make_synthetic.py, --layers decoder layers, shards
of --shard-size in name order: expert 10 before expert 2) is served by tests/fixtures/hubserver.py on
127.0.0.1 (unthrottled, the source in the page cache), and saved with `--stream` twice per round, each
with a fresh HF_HOME and TMPDIR: RESHARD_STREAM_SPILL=0 (bytes read ahead of a file's sha256 beyond the
in-memory buffer fetched a second time, as before reshard.sources.spill) and the default. Reported per
run: bytes the server sent over the source's size, wall and CPU seconds (with a final `sync`), peak RSS,
and the peak bytes allocated in TMPDIR (polled every 0.1 s). The rank files of the two are compared (run id blanked).

With --torchrun N: the cached save (no --stream) under `torchrun --nproc-per-node N`, each round with a
fresh HF_HOME, this tree and (--baseline) another checkout alternately: bytes served over the source's
size (each file's blob is filled by one process; the others fetch what they use, and the rest for the
sha256 from that blob once published) and wall seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench_hub import DiskPeak
from scripts.benchlib import ROOT, fmt_b, run_measured
from tests.fixtures.hubrun import REPO, serving


def digests(folder: Path) -> dict[str, str]:
    """Each rank file's sha256, the run id (the one thing that differs between runs) blanked."""
    run = json.loads((folder / "reshard.json").read_text())["run_id"].encode()
    blank = b"0" * len(run)
    return {
        p.name: hashlib.sha256(p.read_bytes().replace(run, blank)).hexdigest()
        for p in sorted(folder.glob("model-rank-*"))
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench_stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-size", default="600MB")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-stream")
    ap.add_argument("--torchrun", type=int, help="processes of a cached (not --stream) save under torchrun")
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--baseline", type=Path, help="with --torchrun: another checkout to time alternately")
    ap.add_argument("--rate", type=float, help="bytes/s per response (the server's pace; default: unthrottled)")
    a = ap.parse_args(argv)
    work = a.work.resolve()
    src = work / "src"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        make = [sys.executable, "-m", "scripts.make_synthetic", str(src), "--arch", "qwen3-moe"]
        subprocess.run([*make, "--layers", str(a.layers), "--shard-size", a.shard_size], cwd=ROOT, check=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    if a.torchrun:
        return torchrun_rounds(a, work, src, size)
    runs, outputs = [], {}
    with serving(src) as server:
        for rep in range(a.reps):
            for spill in ("0", "default"):
                run = work / f"run-{spill}"
                shutil.rmtree(run, ignore_errors=True)
                (run / "tmp").mkdir(parents=True)
                env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
                env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(run / "hf"), TMPDIR=str(run / "tmp"))
                env.update(RESHARD_DISABLE_PROGRESS="1", PYTHONPATH=str(ROOT))
                env.pop("RESHARD_STREAM_SPILL", None)
                if spill == "0":
                    env["RESHARD_STREAM_SPILL"] = "0"
                cmd = [sys.executable, "-m", "reshard", "save", REPO, str(run / "out"), "--tp", str(a.tp), "--stream"]
                before = server.served
                with DiskPeak(run / "tmp") as disk:
                    m = run_measured(cmd, log=work / "log.txt", env=env)
                rec = {"spill": spill, "rep": rep, "served": server.served - before, "tmp_peak": disk.peak}
                rec.update({k: m[k] for k in ("seconds", "cpu", "rss")})
                runs.append(rec)
                print(json.dumps(rec), flush=True)
                outputs[spill] = digests(run / "out")
                shutil.rmtree(run, ignore_errors=True)
    same = outputs["0"] == outputs["default"] and bool(outputs["0"])
    print(f"\nsource {fmt_b(size)} in {len(list(src.glob('*.safetensors')))} files, --tp {a.tp}, {a.reps} rounds")
    print("\n| RESHARD_STREAM_SPILL | served / source | wall s | CPU s | peak RSS | TMPDIR peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for spill in ("0", "default"):
        rs = [r for r in runs if r["spill"] == spill]
        print(
            f"| {spill} | {max(r['served'] for r in rs) / size:.3f} | {statistics.median(r['seconds'] for r in rs):.1f} "
            f"| {statistics.median(r['cpu'] for r in rs):.1f} | {fmt_b(max(r['rss'] for r in rs))} "
            f"| {fmt_b(max(r['tmp_peak'] for r in rs))} |"
        )
    print(f"\nrank files identical between the two: {same}")
    return 0 if same else 1


def torchrun_rounds(a: argparse.Namespace, work: Path, src: Path, size: int) -> int:
    from tests.fixtures.torchrun import torchrun

    trees = [("this tree", ROOT)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    runs = []
    with serving(src) as server:
        server.rate = a.rate
        for rep in range(a.reps):
            for label, tree in trees:
                run = work / "run-torchrun"
                shutil.rmtree(run, ignore_errors=True)
                run.mkdir(parents=True)
                env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
                env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(run / "hf"), PYTHONPATH=str(tree))
                env.update(RESHARD_DISABLE_PROGRESS="1", OMP_NUM_THREADS="1")
                args = ["-m", "reshard", "save", REPO, str(run / "out"), "--tp", str(a.tp), *(["--ep"] if a.ep else [])]
                before, t0 = server.served, time.perf_counter()
                p = torchrun(run / "logs", args, env, nproc=a.torchrun, timeout=3600, cwd=tree)  # -m imports from cwd
                rec = {"tree": label, "rep": rep, "rc": p.returncode, "seconds": time.perf_counter() - t0}
                rec["served"] = server.served - before
                runs.append(rec)
                print(json.dumps(rec), flush=True)
                shutil.rmtree(run, ignore_errors=True)
    pace = f", {a.rate / 1e6:.0f} MB/s per response" if a.rate else ", unthrottled"
    print(f"\nsource {fmt_b(size)}, torchrun --nproc-per-node {a.torchrun}, --tp {a.tp}{' --ep' if a.ep else ''}{pace}")
    print("\n| tree | served / source | wall s |\n|---|---:|---:|")
    for label, _ in trees:
        rs = [r for r in runs if r["tree"] == label]
        print(
            f"| {label} | {max(r['served'] for r in rs) / size:.3f} | {statistics.median(r['seconds'] for r in rs):.1f} |"
        )
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
