#!/usr/bin/env python
"""Issue 28's scale figures: per-tensor costs on checkpoints of hundreds of thousands of tensors.

    python -m scripts.bench scale [--work DIR] [--rounds 3] [--quick] [--keep] [--json] [--out FILE]

(`make bench` runs it too, as section 8; either way its section of docs/benchmarks.md is rewritten.)

1. A Qwen3-MoE checkpoint of tiny tensors (hidden 64, moe_intermediate 32, head_dim 16, 128 layers of
   512 experts: 197,763 tensors, 0.87 GB; scripts/make_synthetic.py's writer with these overrides):
   `plan --tp 8`, `plan --tp 8 --ep`, `save --tp 8` and `save --tp 8 --ep`, the source in the page cache.
2. A header-only copy of Kimi-K2 (tests/fixtures/releases: 61 layers, 384 experts, block FP8, the
   release's names; data regions are holes): `plan --tp 8 --ep`.
3. A header of 1M junk tensors beside a tiny Llama's own (one model.safetensors): `save --tp 8`,
   refused with exit 4 (the junk matches no rule).
4. The TP 8 output of (1) read back: `merge` to a Hugging Face folder and `save OUT NEW --tp 4`
   (re-shard without the original), each against `cp -r` of that output, within a save's memory bound.

Every command runs in its own process under /usr/bin/time (wall, CPU, peak RSS), then `sync`; each
round times `cp -r SRC` + `sync` of the same folder right before it, and ratios are medians of the
per-round ratios (a slow period of a shared machine hurts both sides alike). --quick: 32 layers,
200k junk tensors, one round (a smoke run, not the issue's figures).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from reshard.format import ITEMSIZE, encode_header
from scripts.benchlib import GIB, ROOT, TIME, fmt_b, fmt_s, med, put_section, timed_alone
from scripts.make_synthetic import make_config, write_checkpoint

MIB = 2**20
# the bounds: command wall / (cp -r + sync) wall, and seconds / bytes
TARGETS = {
    "plan --tp 8": 2.0,
    "save --tp 8": 6.0,
    "save --tp 8 --ep": 4.0,
}
HEADING = "## 8. Scale: 200k-tensor MoE, a 1M-tensor header, Kimi-K2's headers (issue 28)"
JUNK_SECONDS, JUNK_RSS = 10.0, 768 * MIB
OUTPUT_RSS = 768 * MIB  # reading an output back: a save's bound (--max-memory's default + 256 MiB)
KIMI_SECONDS, KIMI_RSS = 5.0, GIB


def moe_config(layers: int, experts: int = 512) -> dict:
    """Qwen3-30B-A3B's config with tiny tensors: every expert 32 x 64 (4 KB in bf16)."""
    c = make_config("qwen3-moe", 1, fp8=False, layers=layers)
    c.update(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, head_dim=16, num_experts=experts)
    return c


def write_junk(folder: Path, junk: int) -> dict:
    """A tiny Llama's tensors and `junk` more one-element tensors that no rule reads, in one
    model.safetensors whose data is a hole (planning never reads it)."""
    from tests.fixtures.synthetic import tensor_specs

    config = make_config("llama", 1, fp8=False, layers=2)
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024)
    specs = tensor_specs(config) + [(f"model.junk.{i}.weight", "BF16", (1,)) for i in range(junk)]
    folder.mkdir(parents=True, exist_ok=True)
    raw = encode_header(specs, {"format": "pt"})
    with open(folder / "model.safetensors", "wb") as f:
        f.write(raw)
        f.truncate(len(raw) + sum(math.prod(s) * ITEMSIZE[d] for _, d, s in specs))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"path": str(folder), "tensors": len(specs), "header_bytes": len(raw)}


def write_kimi(folder: Path) -> dict:
    from tests.fixtures.releases import RELEASES, specs, write_header_only

    write_header_only(folder, RELEASES["kimi-k2"])
    return {"path": str(folder), "tensors": len(specs(RELEASES["kimi-k2"]))}


def timed(cmd: list[str], log: Path, *, ok: tuple[int, ...] = (0,)) -> dict:
    """`cmd` under /usr/bin/time in its own process, then sync: wall, CPU and peak RSS."""
    out = log.with_suffix(".time")
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        t0 = time.perf_counter()
        rc = subprocess.call([str(TIME), "-f", "%e %U %S %M", "-o", str(out), *cmd], stdout=f, stderr=f, cwd=ROOT)
        os.sync()
        wall = time.perf_counter() - t0
    if rc not in ok:
        raise RuntimeError(f"{' '.join(cmd[:6])} exited {rc}, expected {ok}: see {log}")
    _, user, sys_, rss = out.read_text().split()[-4:]
    out.unlink()
    return {"seconds": wall, "cpu": float(user) + float(sys_), "rss": int(rss) * 1024, "rc": rc}


def cp_sync(src: Path, work: Path, log: Path) -> dict:
    """`cp -r SRC DST && sync`, timed; DST removed afterwards (not timed)."""
    dst = work / "cpout"
    shutil.rmtree(dst, ignore_errors=True)
    r = timed(["cp", "-r", str(src), str(dst)], log)
    shutil.rmtree(dst)
    return r


def warm(src: Path) -> None:
    """The source in the page cache (the issue's 'source cached')."""
    for p in sorted(src.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


# (label, source key, reshard arguments, exit codes that count as done). The header-only sources
# (junk, kimi) have absolute bounds: their data are holes, neither warmed nor copied.
CASES = (
    ("plan --tp 8", "moe", ["plan", "{src}", "--tp", "8"], (0,)),
    ("plan --tp 8 --ep", "moe", ["plan", "{src}", "--tp", "8", "--ep"], (0,)),
    ("save --tp 8", "moe", ["save", "{src}", "{out}", "--tp", "8"], (0,)),
    ("save --tp 8 --ep", "moe", ["save", "{src}", "{out}", "--tp", "8", "--ep"], (0,)),
    ("junk header: save --tp 8 (exit 4)", "junk", ["save", "{src}", "{out}", "--tp", "8"], (4,)),
    ("kimi-k2 headers: plan --tp 8 --ep", "kimi", ["plan", "{src}", "--tp", "8", "--ep"], (0,)),
    ("TP 8 output: merge", "moe-out", ["merge", "{src}", "{out}"], (0,)),
    ("TP 8 output: save --tp 4", "moe-out", ["save", "{src}", "{out}", "--tp", "4"], (0,)),
)


def run(a: argparse.Namespace) -> dict:
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench_scale.log"
    log.write_text("")
    layers, junk = (32, 200_000) if a.quick else (128, 1_000_000)
    say = lambda msg: print(f"[bench_scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    sources = {"moe": work / f"moe-{layers}x512", "junk": work / f"junk-{junk}", "kimi": work / "kimi-k2"}
    made = {}
    for key, path in sources.items():
        if not path.exists():
            say(f"writing {path.name}")
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            if key == "moe":
                made[key] = write_checkpoint(tmp, moe_config(layers))
            else:
                made[key] = write_junk(tmp, junk) if key == "junk" else write_kimi(tmp)
            tmp.rename(path)
    sources["moe-out"] = work / f"moe-{layers}x512-tp8"
    if "moe" in made:  # a new source: its output again
        shutil.rmtree(sources["moe-out"], ignore_errors=True)
    if not sources["moe-out"].exists():  # the output read back by the last cases
        say(f"writing {sources['moe-out'].name}")
        cmd = [sys.executable, "-m", "reshard", "save", str(sources["moe"]), str(sources["moe-out"]), "--tp", "8"]
        timed(cmd, log)
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "quick": a.quick,
        "rounds": a.rounds,
        "layers": layers,
        "junk": junk,
        "cases": {},
    }
    out = work / "out"
    for rnd in range(a.rounds):
        for label, key, args, ok in CASES:
            src = sources[key]
            cmd = [sys.executable, "-m", "reshard", *(x.format(src=src, out=out) for x in args)]
            data = key in ("moe", "moe-out")
            with timed_alone():
                if data:
                    warm(src)
                cp = cp_sync(src, work, log) if data else None
                shutil.rmtree(out, ignore_errors=True)
                r = timed(cmd, log, ok=ok)
                shutil.rmtree(out, ignore_errors=True)
            entry = results["cases"].setdefault(label, {"runs": [], "cp": []})
            entry["runs"].append(r)
            entry["cp"].append(cp)
            said = f"; cp {fmt_s(cp['seconds'])} s" if cp else ""
            say(f"round {rnd + 1} {label}: {fmt_s(r['seconds'])} s, {fmt_b(r['rss'])}{said}")
    for e in results["cases"].values():
        e["seconds"] = med([r["seconds"] for r in e["runs"]])
        e["cpu"] = med([r["cpu"] for r in e["runs"]])
        e["rss"] = max(r["rss"] for r in e["runs"])
        if all(e["cp"]):
            e["cp_seconds"] = med([c["seconds"] for c in e["cp"]])
            e["ratio"] = med([r["seconds"] / c["seconds"] for r, c in zip(e["runs"], e["cp"], strict=True)])
    if not a.keep:
        shutil.rmtree(work)
    return results


def report(results: dict) -> str:
    lines = [
        f"{'case':36s} {'wall s':>7s} {'CPU s':>7s} {'peak RSS':>9s} {'cp+sync s':>9s} {'ratio':>6s}  target",
    ]
    for label, e in results["cases"].items():
        if label in TARGETS:
            target = f"<= {TARGETS[label]:g}x cp"
        elif label.startswith("junk"):
            target = f"<= {JUNK_SECONDS:g} s, <= {fmt_b(JUNK_RSS)}"
        elif label.startswith("kimi"):
            target = f"<= {KIMI_SECONDS:g} s, <= {fmt_b(KIMI_RSS)}"
        elif label.startswith("TP 8 output"):
            target = f"<= {fmt_b(OUTPUT_RSS)}"
        else:
            target = ""
        lines.append(
            f"{label:36s} {fmt_s(e['seconds']):>7s} {fmt_s(e['cpu']):>7s} {fmt_b(e['rss']):>9s} "
            + (f"{fmt_s(e['cp_seconds']):>9s} {e['ratio']:6.2f}" if "ratio" in e else f"{'-':>9s} {'-':>6s}")
            + f"  {target}"
        )
    n = results["rounds"]
    lines.append(
        f"medians of {n} round(s); ratio: median of per-round wall / (cp -r + sync of the same folder, same round); "
        f"peak RSS: the largest of the rounds; {results['layers']} layers x 512 experts, {results['junk']} junk tensors"
    )
    return "\n".join(lines)


def section(results: dict) -> str:
    """docs/benchmarks.md's section 8 from `run`'s results."""
    when = results.get("date", "")
    return (
        f"{HEADING}\n\n"
        f"`python -m scripts.bench scale` ({when}; {results['rounds']} round(s), the source in the page cache). "
        "Per-tensor costs: a Qwen3-MoE of 197,763 tiny tensors (hidden 64, moe_intermediate 32, 128 layers x "
        "512 experts, 0.87 GB bf16), a Llama whose header holds 1M junk tensors (refused, exit 4), and a "
        "header-only copy of Kimi-K2 (61 layers, 384 experts, block FP8); then the MoE's TP 8 output read back "
        "(`merge`, and `save OUT NEW --tp 4`). Each MoE command is timed against "
        "`cp -r` + `sync` of the same folder in the same round; `--max-memory` is the default 512 MiB, so the "
        "RSS bound is 768 MiB.\n\n```\n" + report(results) + "\n```\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-scale", help="scratch folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="32 layers, 200k junk tensors, one round")
    ap.add_argument("--keep", action="store_true", help="keep --work (the checkpoints are reused next time)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="section 8 rewritten here")
    a = ap.parse_args(argv)
    if a.quick and "--rounds" not in (argv if argv is not None else sys.argv[1:]):
        a.rounds = 1
    results = run(a)
    print(json.dumps(results, indent=1) if a.json else report(results))
    if not a.quick:
        put_section(a.out, HEADING, section(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
