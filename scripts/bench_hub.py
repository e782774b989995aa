"""`python -m scripts.bench hub`: `reshard save --tp 8 REPO` from a local Hub server (issue 16).

    python -m scripts.bench hub [--size 2GB] [--rate 500MB] [--reps 2] [--baseline /path/to/old/tree]

A synthetic Llama checkpoint of --size (scripts/make_synthetic.py) is served by
tests/fixtures/hubserver.py on 127.0.0.1, each response throttled to --rate bytes/s (about what the
disk writes), and saved at --tp 8 four ways, interleaved, each with a fresh HF_HOME:

- sequential: `snapshot_download` (huggingface_hub's own parallel download), then `reshard save` on
  the snapshot folder: the two steps by hand;
- cached: `reshard save --tp 8 REPO` (download and re-sharding overlapped, the source kept once in
  the cache);
- stream: `reshard save --tp 8 REPO --stream` (the source never stored);
- baseline (with --baseline): the same repo-id command run from another checkout (before this change).

The cost of the source integrity check (issue 24: each file hashed with sha256 against the Hub's LFS
sha256): sha256's CPU seconds per GB over the source here, beside each variant's CPU s/GB in all;
`--baseline` a tree before the check gives the wall ratio.

Reported per run: wall seconds (each including a final `sync`), peak RSS, and the peak disk use of
the run's folder (HF_HOME + OUT_DIR + staging + TMPDIR, where `--stream` spills; st_blocks polled every 0.1 s). The source stays in
the page cache (it is the "network" side); the page cache is not dropped, other helpers share the
disk. Raw numbers go to --notes (markdown) and --work/hub-results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.benchlib import ROOT, fmt_b, put_section, run_measured, scrub
from scripts.make_synthetic import parse_size

REPO = "bench/llama-synthetic"
MARK = "<!-- hub-bench: written by `python -m scripts.bench hub --doc docs/benchmarks.md` -->"
HEADING = "## 5. `reshard save --tp 8 REPO` from a Hub server (issue 16)"


class DiskPeak:
    """The largest number of bytes allocated under `root` while it runs (sparse files count as held)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
        return total

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self._used())
            self.stop.wait(0.1)

    def __enter__(self) -> DiskPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._used())


def start_server(src: Path, rate: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tests.fixtures.hubserver", str(src), REPO, "--rate", str(rate)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True)  # noqa: SIM115
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench hub", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("2GB"))
    ap.add_argument("--rate", type=parse_size, default=parse_size("500MB"), help="bytes/s per response")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout whose repo-id save to time too")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-hub")
    ap.add_argument("--notes", type=Path, help="append the raw numbers and commands (markdown) here")
    ap.add_argument("--doc", type=Path, help="write the results as the hub section of this file (docs/benchmarks.md)")
    ap.add_argument("--lock", default="/tmp/bench.lock", help="flock held around each timed run")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    py = sys.executable
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run(
            [py, "-m", "scripts.make_synthetic", str(src), "--arch", "llama", "--size", str(a.size)],
            cwd=ROOT,
            check=True,
        )
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    server, endpoint = start_server(src, a.rate, work / "server.log")
    lock = open(a.lock, "a")  # noqa: SIM115
    runs: list[dict] = []
    try:
        variants = ["sequential", "cached", "stream"] + (["baseline"] if a.baseline else [])
        for rep in range(a.reps):
            for v in variants:
                runs.append(one_run(v, rep, a, work, src, endpoint, lock))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        server.terminate()
        server.wait()
    result = {"size": size, "rate": a.rate, "tp": a.tp, "runs": runs, "load": os.getloadavg()}
    result["sha256_cpu_s_per_gb"] = sha256_cost(src)
    (work / "hub-results.json").write_text(json.dumps(result, indent=1))
    text = summary(result, a)
    print(text)
    if a.notes:
        with open(a.notes, "a") as f:
            f.write(text + "\n\n")
    if a.doc:
        write_doc(a.doc, doc_section(text, result))
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)
    return 0


def write_doc(doc: Path, section: str) -> None:
    """Put `section` (MARK, then the heading) into `doc` in place of the earlier one, the mark kept
    above it (`python -m scripts.bench` keeps what follows the mark), or at the end. The sections
    after it stay: the earlier write cut the file at the mark, and with it sections 6 to 8."""
    if doc.exists() and MARK in doc.read_text():
        put_section(doc, HEADING, section.split("\n", 1)[1])
    else:
        put_section(doc, MARK, section)  # absent: appended


def sha256_cost(src: Path) -> float:
    """CPU seconds per GB (1e9 bytes) of sha256 over the source's safetensors files (page cache warm)."""
    import hashlib

    files = sorted(src.glob("*.safetensors"))
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL)
    t0, n = time.process_time(), 0
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb", buffering=0) as fh:
            while block := fh.read(16 << 20):
                h.update(block)
                n += len(block)
    return (time.process_time() - t0) / (n / 1e9)


def one_run(v: str, rep: int, a: argparse.Namespace, work: Path, src: Path, endpoint: str, lock) -> dict:
    import fcntl

    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    home, out = run / "hf", run / "out"
    (run / "tmp").mkdir()  # the temp folder, where --stream's bytes waiting for the sha256 go: counted too
    env = {
        **os.environ,
        "TMPDIR": str(run / "tmp"),
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "RESHARD_DISABLE_PROGRESS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_TOKEN", None)
    subprocess.run(["cat", *map(str, sorted(src.glob("*.safetensors")))], stdout=subprocess.DEVNULL)  # warm "CDN"
    save = [sys.executable, "-m", "reshard", "save"]
    log = work / f"{v}.log"
    steps: list[tuple[str, list[str], Path]] = []
    if v == "sequential":
        dl = [sys.executable, "-c", f"import huggingface_hub as h; print(h.snapshot_download({REPO!r}))"]
        steps = [("download", dl, ROOT), ("save", [*save, "SNAPSHOT", str(out), "--tp", str(a.tp)], ROOT)]
    elif v == "cached":
        steps = [("save", [*save, REPO, str(out), "--tp", str(a.tp)], ROOT)]
    elif v == "stream":
        steps = [("save", [*save, REPO, str(out), "--tp", str(a.tp), "--stream"], ROOT)]
    else:
        env["PYTHONPATH"] = str(a.baseline)
        steps = [("save", [*save, REPO, str(out), "--tp", str(a.tp)], a.baseline)]
    rec: dict = {"variant": v, "rep": rep, "steps": {}}
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with DiskPeak(run) as disk:
            for name, cmd, cwd in steps:
                if "SNAPSHOT" in cmd:
                    snap = next((home / "hub").glob("models--*/snapshots/*"))
                    cmd = [str(snap) if c == "SNAPSHOT" else c for c in cmd]
                old = os.getcwd()
                os.chdir(cwd)
                try:
                    m = run_measured(cmd, log=log, env=env)
                finally:
                    os.chdir(old)
                rec["steps"][name] = {**m, "cmd": " ".join(cmd)}
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
    rec["seconds"] = sum(s["seconds"] for s in rec["steps"].values())
    rec["rss"] = max(s["rss"] for s in rec["steps"].values())
    rec["cpu"] = sum(s["cpu"] for s in rec["steps"].values())
    rec["disk_peak"] = disk.peak
    rec["output"] = sum(p.stat().st_size for p in out.glob("*") if p.is_file())
    shutil.rmtree(run, ignore_errors=True)
    return rec


def doc_section(text: str, r: dict) -> str:
    by: dict[str, list[float]] = {}
    for run in r["runs"]:
        by.setdefault(run["variant"], []).append(run["seconds"])
    seq = statistics.median(by["sequential"])
    ratio = {v: statistics.median(xs) / seq for v, xs in by.items()}
    out = max(run["output"] for run in r["runs"])
    disk = max(run["disk_peak"] for run in r["runs"] if run["variant"] == "stream")

    def met(ok: bool) -> str:
        return "yes" if ok else "no"

    lines = [
        MARK,
        HEADING,
        "",
        "A synthetic Llama checkpoint served by tests/fixtures/hubserver.py on 127.0.0.1 (the Hub's HTTP "
        "interface: model info, resolve with a 302 to a CDN origin, Range), each response throttled to "
        "--rate. sequential = huggingface_hub's `snapshot_download` (8 files at a time) then `reshard save` "
        "on the snapshot; cached = the repo id (download and re-sharding overlapped, the source kept once in "
        "the HF cache); stream = the repo id with `--stream` (nothing stored); baseline = the repo-id save "
        "before this change (snapshot_download inside reshard, then the save). Every time includes a final "
        "`sync`; disk peak = allocated blocks of HF_HOME + OUT_DIR + staging + TMPDIR, polled every 0.1 s. The machine "
        "is shared (load average in the title): read the ratios, not the seconds.",
        "",
        text.replace("### hub bench", "####"),
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| cached repo-id save <= 0.7 x sequential | {ratio['cached']:.2f} | {met(ratio['cached'] <= 0.7)} |",
        f"| --stream repo-id save <= 0.7 x sequential | {ratio['stream']:.2f} | {met(ratio['stream'] <= 0.7)} |",
        f"| --stream disk peak <= output + 1 GB | {fmt_b(disk)} vs {fmt_b(out)} + 1 GB | {met(disk <= out + 1e9)} |",
    ]
    return "\n".join(lines)


def summary(r: dict, a: argparse.Namespace) -> str:
    by: dict[str, list[dict]] = {}
    for run in r["runs"]:
        by.setdefault(run["variant"], []).append(run)
    seq = statistics.median(x["seconds"] for x in by["sequential"])
    lines = [
        f"### hub bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {r['size'] / 1e9:.2f} GB llama, "
        f"--tp {r['tp']}, {r['rate'] / 1e6:.0f} MB/s per response, {a.reps} rounds, load {r['load'][0]:.1f}",
        "",
        "| variant | median s | / sequential | runs (s) | peak RSS | disk peak | output |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, runs in by.items():
        med = statistics.median(x["seconds"] for x in runs)
        each = ", ".join(f"{x['seconds']:.1f}" for x in runs)
        lines.append(
            f"| {v} | {med:.1f} | {med / seq:.2f} | {each} | "
            f"{fmt_b(max(x['rss'] for x in runs))} | {fmt_b(max(x['disk_peak'] for x in runs))} | "
            f"{fmt_b(runs[0]['output'])} |"
        )
    seq_steps = by["sequential"][0]["steps"]
    for k in seq_steps:
        lines.append(
            f"- sequential, {k} step (s): " + ", ".join(f"{x['steps'][k]['seconds']:.1f}" for x in by["sequential"])
        )
    if "sha256_cpu_s_per_gb" in r:
        per_gb = {
            v: statistics.median(x["cpu"] for x in runs if "cpu" in x) / (r["size"] / 1e9) for v, runs in by.items()
        }
        lines.append(
            f"- source sha256 check: {r['sha256_cpu_s_per_gb']:.2f} CPU s/GB; each variant's CPU s/GB in all: "
            + ", ".join(f"{v} {c:.2f}" for v, c in per_gb.items())
        )
    lines += ["", "commands:"] + [
        f"- {v}: `{' ; '.join(s['cmd'] for s in runs[0]['steps'].values())}`" for v, runs in by.items()
    ]
    return scrub("\n".join(lines))
