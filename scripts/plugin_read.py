"""One rank's files read by the loader plugin's `read_rank` (no vLLM), page cache dropped first (root).

    python -m scripts.plugin_read OUT [--path cpu|host-buffers] [--rank R] [--rounds N]

`cpu`: the files go straight into CPU parameters (a CPU engine's path). `host-buffers`: the path a
GPU engine's parameters take (every parameter is taken as one the reads cannot land in), here with
CPU parameters and synchronous copies, so that a machine without a GPU can time the reads, the
buffers and the hash of that path. The parameters are allocated and touched before the clock
starts (a GPU's memory costs the host no page faults). Prints one line per round: bytes, seconds,
CPU seconds of the process. Run it with PYTHONPATH=TREE to time another checkout's reader.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch

from reshard.format import DTYPE_CODES
from reshard.layout import Layout
from reshard.manifest import read_manifest
from reshard.vllm_plugin import checks, reader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--path", choices=["cpu", "host-buffers"], default="host-buffers")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    m = read_manifest(args.out)
    lay = m.layout
    engine = checks.Engine(Layout(lay.tp, lay.pp, lay.ep, lay.dtype), None, "0.32.0", tp_rank=args.rank)
    files = checks.check_files(args.out, m, checks.rank_entries(m, engine), engine)
    if args.path == "host-buffers":
        reader._direct = lambda param, shape: False
    for _ in range(args.rounds):
        targets = {
            t.name: torch.full(t.shape, 7, dtype=getattr(torch, DTYPE_CODES.get(t.dtype, "float32")))
            for f in files
            for t in f.tensors
        }
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        n, _, bad = reader.read_rank(
            files, targets, algorithm=m.checksum, threads=4, log=lambda s: None, label=engine.label
        )
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        assert not bad, bad
        print(f"{args.path}: {n / 1e9:.2f} GB in {wall:.2f} s, {cpu:.2f} CPU s, {m.checksum} verified", flush=True)


if __name__ == "__main__":
    main()
