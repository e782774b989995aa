"""How much `save --stream` fetches twice: a simulation of reshard.sources.prefixhash on a release's layout.

    python -m scripts.stream_refetch QWEN3_235B_A22B_FP8 --files 48 --tp 8 [--ep] [--spill BYTES]

The checkpoint is tests/fixtures/synthetic.py's (the real model's names, dtypes and shapes, every
layer) cut into --files shards of whole tensors in name order, each shard's tensors laid out as
safetensors writes them (wider dtypes first, then by name: expert 10 before expert 2). The save's
reads come from the real planner and scheduler, and the bytes the files' hashers would take in again
from `reshard.sources.prefixhash.taken_again` (what a `--stream` save tells at its start): a read ahead
of its file's hash is held while the held bytes stay within PENDING, then waits on disk while the spill
(RESHARD_STREAM_SPILL, reshard.sources.spill) has room, and one beyond is fetched again. Printed for no
spill and for --spill (default: the setting's default).
"""

from __future__ import annotations

import argparse
import math

from reshard.checkpoint import Checkpoint
from reshard.format import ITEMSIZE, TensorInfo
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.schedule import DEFAULT_CHUNK, schedule
from reshard.settings import STREAM_SPILL
from reshard.sources.prefixhash import PENDING, taken_again
from tests.fixtures import synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a config of tests/fixtures/synthetic.py, e.g. QWEN3_235B_A22B_FP8, LLAMA_3_70B")
    ap.add_argument("--files", type=int, default=48)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--spill", type=int, default=STREAM_SPILL.default, help="bytes the spill may hold")
    a = ap.parse_args()
    cfg = getattr(synthetic, a.model)
    specs = synthetic.tensor_specs(cfg)
    per = math.ceil(len(specs) / a.files)
    shards = [specs[i : i + per] for i in range(0, len(specs), per)]
    tensors, names = {}, []
    for k, shard in enumerate(shards):
        f = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        names.append(f)
        off = 0
        for name, dt, shape in sorted(shard, key=lambda s: (-ITEMSIZE[s[1]], s[0])):
            n = math.prod(shape) * ITEMSIZE[dt]
            tensors[name] = TensorInfo(name, dt, shape, f, off, n)
            off += n
    ckpt = Checkpoint(None, cfg, tensors, names, {"path": "synthetic"})
    steps = schedule(build_plan(ckpt, Layout(tp=a.tp, ep=a.ep)), tensors, DEFAULT_CHUNK)
    reads = [r for step in steps for r in step.reads]
    total = sum(r.nbytes for r in reads)
    ranges = [(r.info.file, r.info.offset + r.start, r.info.offset + r.start + r.nbytes) for r in reads]
    for spill in (0, a.spill):  # with a spill, the files share one file's bound in memory (HubSource)
        again = taken_again(ranges, PENDING // len(names) if spill else PENDING, spill=spill)
        print(
            f"{a.model} --tp {a.tp}{' --ep' if a.ep else ''}, {len(names)} files, spill {spill / 2**30:.1f} GiB: "
            f"read {total / 1e9:.2f} GB, fetched again by --stream {again / 1e9:.2f} GB ({again / total:.0%})"
        )


if __name__ == "__main__":
    main()
