#!/usr/bin/env python
"""reshard's benchmark: `make bench` runs it and writes docs/benchmarks.md.

    python -m scripts.bench [--size 4GB] [--big-size 16GB] [--reps 3] [--quick] [--skip-vllm]

0. The disk's own O_DIRECT sequential read and write speeds (the physical limit: a save reads and
   writes every byte once).
1. `reshard save --tp 8` against `cp -r` + `sync` of the same checkpoint (and a naive script: for
   each rank `safetensors.torch.load_file` every shard, slice with torch as reshard's plan says,
   `save_file`), on a Llama-3-8B-shaped bf16 checkpoint, a Qwen3-30B-A3B-shaped and a
   Qwen3-235B-A22B-shaped block-FP8 MoE (scripts/make_synthetic.py) of --size, with the page
   cache dropped before each run and with the source already in it (warm). Repetitions are
   interleaved (A B A B ...); ratios are medians of per-round ratios, so a slow period hurts both
   sides of a ratio alike. CPU seconds (user + sys of the child, from its rusage) per GB written.
   Every timed run holds --lock (flock), so that timed runs of several benchmarks never overlap.
2. Peak RSS of `reshard save` on a --small-size and a --big-size checkpoint (the big one larger
   than half of this machine's memory when the disk allows), next to the largest tensor.
3. One rank's load: time and bytes read (/proc/self/io read_bytes, after dropping the cache) to
   get its tensors from the reshard output, against reading and narrowing them from the original
   checkpoint as vLLM's default loader does (every rank reads every shard).
4. With .venv-vllm (a vLLM build): vLLM's own "Loading weights took" for load_format
   "sharded_state" against the default loader, at T=2.
5. `build_plan`'s time from headers alone.
6. What checking the source costs (scripts/bench_check.py): `reshard save REPO` of the --small-size
   checkpoint from a local Hub server, cached download, --stream and from a complete cache, each with
   the sha256 check on and off (CPU s/GB, wall on / off). `python -m scripts.bench check` runs it alone.
7. Saving to object storage (scripts/bench_s3.py, a local SeaweedFS): `save SRC s3://` vs uploading
   the saved folder with the same client, Hub -> S3 `--stream` vs `hf download` + save + upload (and
   the local disk it uses), peak RSS of a save to s3:// on the --small-size and --big-size checkpoints.
   `python -m scripts.bench s3` runs it alone; skipped (a note) where no `weed` binary is installed.

8. Scale (scripts/bench_scale.py): plan and save of a 197,763-tensor MoE vs `cp -r`, a 1M-tensor
   header refused, Kimi-K2's headers planned (issue 28). `python -m scripts.bench scale` runs it alone.

`python -m scripts.bench loaders` (scripts/bench_loaders.py) measures vLLM's load time for
`--load-format reshard` (reshard's plugin) against sharded_state and the default loader, cold and
warm page cache.

Everything is written under --work (default build/bench, git-ignored) and removed at the end
unless --keep. Internal sub-commands (_naive, _load) run the measured pieces in their own
processes.

Modules: scripts/benchlib.py (measuring, formatting, the run's settings), one per section
(bench_save.py: 1 and 2, bench_rank.py: 3, bench_vllm.py: 4, bench_plan.py: 5, bench_check.py: 6,
bench_s3.py: 7, bench_scale.py: 8), bench_report.py
(docs/benchmarks.md from the results), and this one: the run in order and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from scripts import bench_check, bench_plan, bench_rank, bench_s3, bench_save, bench_scale, bench_vllm
from scripts.bench_report import keep_hub_section, previous, report
from scripts.benchlib import GB, ROOT, Bench, disk_speeds, machine, section_of, timed_alone
from scripts.make_synthetic import parse_size


def run(b: Bench) -> None:
    """Every section in turn; then results.json under --work, and --out rewritten (other sections kept)."""
    a = b.a
    b.work.mkdir(parents=True, exist_ok=True)
    b.log.write_text("")
    t_start = time.perf_counter()
    b.results["machine"] = machine(b.work)
    b.results["load_start"] = os.getloadavg()
    b.say(f"page cache: {'dropped before each run' if b.cache.enabled else 'NOT dropped (not root)'}")
    try:
        llama = b.make("llama", "llama", a.size)
        b.say("0. the disk's O_DIRECT speeds")
        with timed_alone():
            b.cache.drop([Path(llama["path"])])
            b.results["disk"] = disk_speeds(sorted(Path(llama["path"]).glob("*.safetensors")), b.work / "disk-scratch")
        b.say(f"1. save --tp {a.tp} vs cp -r vs naive")
        b.results["compare"] = [bench_save.compare(b, llama, a.tp, s) for s in ("dropped", "warm")]
        if a.moe:
            for name, arch in (("qwen3-moe-fp8", "qwen3-moe"), ("qwen3-235b-fp8", "qwen3-235b")):
                moe = b.make(name, arch, a.size, fp8=True)
                b.results["compare"] += [bench_save.compare(b, moe, a.tp, s) for s in ("dropped", "warm")]
                shutil.rmtree(moe["path"])
        b.say("3. per-rank load")
        b.results["per_rank"] = bench_rank.per_rank(b, llama, a.tp)
        if a.vllm:
            b.say("4. vLLM load time")
            b.results["vllm"] = bench_vllm.vllm(b, llama, 2)
        b.say("5. planning time")
        b.results["plan"] = bench_plan.plan_times()
        small = b.make("llama-small", "llama", a.small_size)
        if a.check:
            b.say("6. source check cost")
            reps, rate = min(a.reps, 3), parse_size("500MB")
            b.results["source_check"] = bench_check.source_check(b.work, Path(small["path"]), a.tp, reps, rate)
        if a.s3:
            b.say("7. object storage")
            try:
                sizes = [a.small_size, min(a.big_size, int((b.free() - 4 * GB) / 2.2))]
                b.results["s3"] = bench_s3.run(
                    b.work, size=a.small_size, rss_sizes=sizes, tp=a.tp, reps=min(a.reps, 3), rate=parse_size("50MB")
                )
            except FileNotFoundError as e:
                b.notes.append(f"section 7 (object storage) skipped: {e}")
        if a.scale:
            b.say("8. scale")
            sa = argparse.Namespace(work=b.work / "scale", rounds=min(a.reps, 3), quick=a.quick, keep=a.keep)
            b.results["scale"] = bench_scale.run(sa)
        b.say("2. peak RSS")
        rss = [bench_save.rss(b, small, a.tp)]
        shutil.rmtree(small["path"])
        rss.append(bench_save.rss(b, llama, a.tp))
        shutil.rmtree(llama["path"])
        big_size = a.big_size
        room = b.free() - 2 * GB
        if big_size * 2.05 > room:
            fit = int(room / 2.05)
            b.notes.append(
                f"--big-size {big_size / GB:.0f} GB and its output do not fit the free disk "
                f"({b.free() / GB:.0f} GB): used {fit / GB:.1f} GB"
            )
            big_size = fit
        if big_size > a.size:
            big = b.make("llama-big", "llama", big_size)
            rss.append(bench_save.rss(b, big, a.tp))
            shutil.rmtree(big["path"])
        b.results["rss"] = rss
    finally:
        b.results["load_end"] = os.getloadavg()
        b.results["minutes"] = (time.perf_counter() - t_start) / 60
        b.results.update(notes=b.notes, cache=b.cache.describe(), argv=a.argv, reps=a.reps)
        (b.work / "results.json").write_text(json.dumps(b.results, indent=1, default=str))
        if not a.keep:
            for p in b.work.iterdir():
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
    from scripts.bench_loaders import HEADING as LOADERS

    text = keep_hub_section(a.out, report(b.results, previous(a.out)))  # `bench hub`'s section survives a full run
    if "scale" in b.results and not a.quick:
        text = f"{text.rstrip()}\n\n{bench_scale.section(b.results['scale'])}"
    for heading in (LOADERS, bench_scale.HEADING):  # and so do `bench loaders`' and `bench scale`'s
        kept = section_of(a.out, heading)
        if kept and heading not in text:
            text = f"{text.rstrip()}\n\n{kept}"
    a.out.write_text(text)
    b.say(f"wrote {a.out} in {b.results['minutes']:.1f} min")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "hub":  # reshard save from a local Hub server (scripts/bench_hub.py)
        from scripts.bench_hub import main as hub_main

        return hub_main(argv[1:])
    if argv and argv[0] == "check":  # what checking the source costs, alone (scripts/bench_check.py)
        return bench_check.main(argv[1:])
    if argv and argv[0] == "s3":  # saving to object storage, alone (scripts/bench_s3.py)
        return bench_s3.main(argv[1:])
    if argv and argv[0] == "scale":  # issue 28's per-tensor costs, alone (scripts/bench_scale.py)
        return bench_scale.main(argv[1:])
    if argv and argv[0] == "loaders":  # vLLM load time by loader, reshard's plugin included
        from scripts import bench_loaders

        return bench_loaders.main(argv[1:])
    if argv and argv[0] == "_naive":
        p = argparse.ArgumentParser()
        p.add_argument("src", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--tp", type=int, default=8)
        x = p.parse_args(argv[1:])
        bench_save.cmd_naive(x.src, x.out, x.tp)
        return 0
    if argv and argv[0] == "_load":
        p = argparse.ArgumentParser()
        p.add_argument("mode", choices=["sharded", "default", "slice"])
        p.add_argument("path", type=Path)
        p.add_argument("--tp", type=int, default=8)
        p.add_argument("--rank", type=int, default=0)
        x = p.parse_args(argv[1:])
        bench_rank.cmd_load(x.mode, x.path, x.tp, x.rank, None)
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size", type=parse_size, default=parse_size("4GB"), help="checkpoint size for 1 and 3 (default 4GB)"
    )
    ap.add_argument("--small-size", type=parse_size, default=parse_size("2GB"), help="small checkpoint for 2 and 4")
    ap.add_argument(
        "--big-size", type=parse_size, default=parse_size("16GB"), help="big checkpoint for 2 (default 16GB)"
    )
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--vllm-reps", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 GB checkpoints, 2 rounds, no MoE, no vLLM")
    ap.add_argument("--skip-vllm", dest="vllm", action="store_false")
    ap.add_argument("--skip-moe", dest="moe", action="store_false")
    ap.add_argument("--skip-naive", dest="naive", action="store_false")
    ap.add_argument("--skip-check", dest="check", action="store_false", help="no section 6 (source check cost)")
    ap.add_argument("--skip-s3", dest="s3", action="store_false", help="no section 7 (object storage)")
    ap.add_argument("--skip-scale", dest="scale", action="store_false", help="no section 8 (200k tensors)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and logs under --work")
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --work/results.json, run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        results = json.loads((a.work / "results.json").read_text())
        a.out.write_text(keep_hub_section(a.out, report(results, previous(a.out))))
        return 0
    a.argv = argv
    if a.quick:
        a.size, a.small_size, a.big_size = parse_size("1GB"), parse_size("1GB"), parse_size("2GB")
        a.reps, a.vllm, a.moe = min(a.reps, 2), False, False
    a.out.parent.mkdir(parents=True, exist_ok=True)
    run(Bench(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
