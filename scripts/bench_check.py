"""Section 6 of `python -m scripts.bench`: what checking the source costs (issue 24).

    python -m scripts.bench check [--size 300MB] [--tp 2] [--reps 3] [--rate 500MB] [--doc docs/benchmarks.md]

A synthetic Llama checkpoint is served by tests/fixtures/hubserver.py on 127.0.0.1 (each response
throttled to --rate) and `reshard save REPO` is timed three ways, each with the check on (as shipped)
and off, interleaved (on, off, on, off, ...):

- cached download: a fresh HF_HOME; each file hashed from the ranges as they arrive, the rest when
  the cache's copy is completed;
- --stream: a fresh HF_HOME, nothing stored; the bytes no rank needs are fetched for the hash;
- from the cache: HF_HOME already holds the whole commit (page cache warm); each file hashed in one
  sequential pass before the save reads it.

"Off" is the same command run by `python -m scripts.bench_check off ...`, which replaces reshard's
source hashing in that process with nothing (every file recorded `unchecked`): reshard itself has
no switch to turn the check off, on purpose. "On" runs through the same wrapper (`on`), so both pay
the same start-up. Reported: wall seconds (each followed by `sync`), the child's CPU seconds (user +
sys), per GB of source, the check's share (on - off), the wall ratio on / off (median of per-round
ratios), peak RSS, and sha256 alone over the same files in this process (one core).
"""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.bench_hub import sha256_cost  # sha256 alone over the same files, the yardstick

MODES = ("cached download", "--stream", "from the cache")


def no_check() -> None:
    """Turn reshard's source check off in this process: no source byte hashed, nothing fetched for
    a hash, every file recorded `unchecked`. The benchmark's baseline only."""
    from reshard.manifest.schema import SourceFileRecord
    from reshard.sources import hubsource, local
    from reshard.sources.integrity import UNCHECKED

    class NoHash:
        def __init__(self, size: int, where: str = "") -> None:
            self.pos = size  # hashed to the end already: no read is ahead of it (nothing fetched again)

        def feed(self, pos: int, data: object) -> None:
            pass

    def verify(self, name: str, read: object, hint: str = "") -> None:
        ckpt = self._checkpoint
        ckpt.checked.append(SourceFileRecord(name, ckpt.file_sizes[name], None, UNCHECKED))

    def check_files(root, files, sizes, expected, fix=None):  # the signature of reshard's
        return [SourceFileRecord(n, sizes.get(n, 0), None, UNCHECKED) for n in files]

    for module, name in ((hubsource, "PrefixHasher"), (hubsource.HubSource, "_verify"), (local, "check_files")):
        assert hasattr(module, name), f"scripts/bench_check.py: reshard has no {name} to replace any more"
    hubsource.PrefixHasher = NoHash  # type: ignore[misc,assignment]
    hubsource.HubSource._verify = verify  # type: ignore[method-assign,assignment]
    local.check_files = check_files  # type: ignore[assignment]


def source_check(work: Path, src: Path, tp: int, reps: int, rate: int) -> dict:
    """Time the three modes with the check on and off, `reps` interleaved rounds; the raw runs."""
    import os
    import shutil
    import subprocess

    from scripts.bench_hub import REPO, start_server
    from scripts.benchlib import ROOT, run_measured, timed_alone

    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    server, endpoint = start_server(src, rate, work / "check-server.log")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")},
        "HF_ENDPOINT": endpoint,
        "RESHARD_DISABLE_PROGRESS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": str(ROOT),  # this tree's reshard and scripts
    }
    log, out, full = work / "check.log", work / "check-out", work / "check-hf-full"
    runs: dict[str, dict[str, list[dict]]] = {m: {"on": [], "off": []} for m in MODES}
    commands: dict[str, str] = {}
    try:
        shutil.rmtree(full, ignore_errors=True)
        save = [sys.executable, "-m", "reshard", "save", REPO, str(out), "--tp", str(tp)]
        subprocess.run(save, env={**env, "HF_HOME": str(full)}, cwd=ROOT, check=True, capture_output=True)
        for rep in range(reps):
            for mode in MODES:
                for check in ("on", "off"):
                    home = full if mode == "from the cache" else work / "check-hf"
                    if home != full:
                        shutil.rmtree(home, ignore_errors=True)
                    shutil.rmtree(out, ignore_errors=True)
                    warm = sorted(src.glob("*.safetensors")) + sorted((full / "hub").rglob("blobs/*"))
                    cmd = [sys.executable, "-m", "scripts.bench_check", check, "save", REPO, str(out), "--tp", str(tp)]
                    cmd += ["--stream"] if mode == "--stream" else []
                    commands[mode] = " ".join(["python -m reshard", *cmd[4:]]).replace(str(out), "OUT")
                    with timed_alone():
                        subprocess.run(["cat", *map(str, warm)], stdout=subprocess.DEVNULL)  # "CDN", cache warm
                        r = run_measured(cmd, log=log, env={**env, "HF_HOME": str(home)})
                    runs[mode][check].append(r)
                    print(f"[check] {mode} check {check} round {rep + 1}: {r['seconds']:.2f} s, CPU {r['cpu']:.2f} s")
    finally:
        server.terminate()
        server.wait()
        for p in (out, full, work / "check-hf"):
            shutil.rmtree(p, ignore_errors=True)
    return {
        "bytes": size,
        "tp": tp,
        "rate": rate,
        "reps": reps,
        "load": os.getloadavg(),
        "sha256_cpu_s_per_gb": sha256_cost(src),
        "runs": runs,
        "commands": commands,
    }


def summary(r: dict) -> dict[str, dict]:
    """Per mode: medians on and off, the check's CPU s/GB and the wall ratio on / off."""
    from statistics import median

    gb = r["bytes"] / 1e9
    out = {}
    for mode, by in r["runs"].items():
        on, off = by["on"], by["off"]
        if not on or not off:
            continue
        cpu_on, cpu_off = median(x["cpu"] for x in on), median(x["cpu"] for x in off)
        out[mode] = {
            "wall_on": median(x["seconds"] for x in on),
            "wall_off": median(x["seconds"] for x in off),
            "runs_on": [x["seconds"] for x in on],
            "runs_off": [x["seconds"] for x in off],
            "cpu_per_gb_on": cpu_on / gb,
            "cpu_per_gb_off": cpu_off / gb,
            "check_cpu_per_gb": (cpu_on - cpu_off) / gb,
            "ratio": median(a["seconds"] / b["seconds"] for a, b in zip(on, off, strict=False)),
            "rss_on": max(x["rss"] for x in on),
            "rss_off": max(x["rss"] for x in off),
        }
    return out


def section(r: dict) -> list[str]:
    """The section of docs/benchmarks.md (scripts/bench_report.py renders it from results.json)."""
    from scripts.benchlib import fmt_b, fmt_s

    rows = summary(r)
    sha = r["sha256_cpu_s_per_gb"]
    alone = ""
    if "argv" in r:  # run alone, not by `make bench`
        alone = f", {r.get('started', '')} by `python -m scripts.bench check {' '.join(r['argv'])}`"
    return [
        f"## 6. What checking the source costs (`reshard save --tp {r['tp']} REPO`)",
        "",
        f"A {r['bytes'] / 1e9:.2f} GB synthetic Llama served by tests/fixtures/hubserver.py on 127.0.0.1 "
        f"({r['rate'] / 1e6:.0f} MB/s per response), saved with the source check on (as shipped: every "
        "safetensors file's sha256 against the Hub's LFS sha256) and off (`python -m scripts.bench_check off`: "
        f"the same save with reshard's source hashing replaced by nothing), {r['reps']} interleaved rounds, "
        f"load {r['load'][0]:.1f}{alone}. *cached download*: a fresh HF_HOME, each file hashed from the ranges as they "
        "arrive; *--stream*: nothing stored, the bytes no rank needs fetched for the hash; *from the cache*: the "
        "whole commit already in HF_HOME (page cache warm), hashed in one pass before the save reads it. CPU s: "
        "the child's user + sys, per GB of source; *check*: on - off. The machine is shared: read the ratios.",
        "",
        "| source | wall s on (median, runs) | wall s off (median, runs) | on / off | CPU s/GB on | CPU s/GB off "
        "| check's CPU s/GB | peak RSS on / off |",
        "|---|---|---|---:|---:|---:|---:|---|",
        *[
            f"| {mode} | {fmt_s(x['wall_on'])} ({' '.join(fmt_s(s) for s in x['runs_on'])}) | "
            f"{fmt_s(x['wall_off'])} ({' '.join(fmt_s(s) for s in x['runs_off'])}) | {x['ratio']:.2f} | "
            f"{x['cpu_per_gb_on']:.2f} | {x['cpu_per_gb_off']:.2f} | {x['check_cpu_per_gb']:.2f} | "
            f"{fmt_b(x['rss_on'])} / {fmt_b(x['rss_off'])} |"
            for mode, x in rows.items()
        ],
        "",
        f"sha256 alone over the same files in one process: {sha:.2f} CPU s/GB ({1 / sha:.2f} GB/s on one core). "
        "Commands: " + "; ".join(f"{mode}: `{c}`" for mode, c in r.get("commands", {}).items()) + ".",
        "",
    ]


def splice(doc: Path, lines: list[str]) -> None:
    """Put the section into `doc` where `python -m scripts.bench` renders it: in place of an earlier
    one, else before `## Targets`."""
    text = doc.read_text()
    new = "\n".join(lines).rstrip("\n") + "\n\n"
    head = "## 6. What checking the source costs"
    if head in text:
        start = text.index(head)
        end = text.index("\n## ", start) + 1
    else:
        start = end = text.index("## Targets")
    doc.write_text(text[:start] + new + text[end:])


def main(argv: list[str]) -> int:
    """`python -m scripts.bench check`: this section alone, on a checkpoint of its own."""
    import argparse
    import json
    import shutil
    import subprocess
    import time

    from scripts.benchlib import ROOT, scrub
    from scripts.make_synthetic import parse_size

    ap = argparse.ArgumentParser(prog="python -m scripts.bench check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("300MB"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", type=parse_size, default=parse_size("500MB"), help="bytes/s per response")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-check")
    ap.add_argument("--doc", type=Path, help="write the section into this file (docs/benchmarks.md)")
    a = ap.parse_args(argv)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    cmd = [sys.executable, "-m", "scripts.make_synthetic", str(src), "--arch", "llama", "--size", str(a.size)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        r = source_check(work, src, a.tp, a.reps, a.rate)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    r["argv"], r["started"] = argv, started
    (work / "check-results.json").write_text(json.dumps(r, indent=1))
    lines = [scrub(line) for line in section(r)]
    print("\n".join(lines))
    if a.doc:
        splice(a.doc, lines)
    return 0


if __name__ == "__main__":  # `python -m scripts.bench_check on|off ARGS`: `reshard ARGS`, the check on or off
    if sys.argv[1] == "off":
        no_check()
    from reshard.cli import main as reshard_main

    reshard_main(sys.argv[2:])
