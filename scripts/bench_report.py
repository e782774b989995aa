"""docs/benchmarks.md from `python -m scripts.bench`'s results (build/bench/results.json): `report` renders
it (`--report-only` re-renders it without running anything), keeping the sections a run skipped as the file
had them, `targets` its table of targets, and `keep_hub_section` carries the section `python -m scripts.bench
hub` wrote over a rewrite."""

from __future__ import annotations

import re
from pathlib import Path

from scripts import bench_check, bench_s3_report
from scripts.bench_hub import MARK
from scripts.benchlib import GB, GIB, fmt_b, fmt_s


def report(r: dict, previous: str = "") -> str:
    """docs/benchmarks.md up to the hub section, from a run's results (results.json). A numbered section the run
    did not measure (--skip-vllm, --skip-check, --skip-s3, no `weed`) keeps its text from `previous` (the file
    being rewritten: its date line, and the sections written by hand after it, up to the next numbered section
    or the targets), where a partial re-run dropped it."""
    L = _machine(r)
    kept = _previous_sections(previous)
    measured = {
        "disk": _disk,
        "compare": _compare,
        "rss": _rss,
        "per_rank": _per_rank,
        "vllm": _vllm,
        "plan": _plan,
        "source_check": lambda r: bench_check.section(r["source_check"]),
        "s3": lambda r: bench_s3_report.section(r["s3"]),
    }
    for number, (key, section) in enumerate(measured.items()):  # numbered 0 to 7 in this order
        if r.get(key):  # the sections a run measured
            L += section(r)
        elif number in kept:
            L += kept[number]
    return "\n".join([*L, *targets(r), *_how(), *_notes(r.get("notes", [])), *_commands(r)])


_NUMBERED = re.compile(r"^## (\d+)\. ", re.MULTILINE)
# where a kept section ends: the next heading `report` writes itself
_STOP = re.compile(r"^## (\d+\. |Targets$|How `reshard save` gets there$|Notes$|Commands$)", re.MULTILINE)


def _previous_sections(previous: str) -> dict[int, list[str]]:
    """The numbered sections of a report (before the hub section, whose own "## 5." is not the report's), each
    up to the next numbered section or the targets, as lines ending with a blank one."""
    text = previous[: previous.index(MARK)] if MARK in previous else previous
    out: dict[int, list[str]] = {}
    for m in _NUMBERED.finditer(text):
        stop = _STOP.search(text, m.end())
        out.setdefault(
            int(m.group(1)), [*text[m.start() : stop.start() if stop else None].rstrip("\n").split("\n"), ""]
        )
    return out


def _machine(r: dict) -> list[str]:
    m, argv = r["machine"], r.get("argv", [])
    return [
        "# Benchmarks",
        "",
        f"Written by `make bench` (`python -m scripts.bench{' ' + ' '.join(argv) if argv else ''}`) on "
        f"{r['started']}, in {r['minutes']:.0f} min. Checkpoints are synthetic (`python -m scripts.make_synthetic`): "
        "the real architectures' tensor names, shapes and dtypes with fewer layers, sharded like a Hub download.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPUs | {m['nproc']} × {m['cpu']} |",
        f"| RAM | {m['ram'] / GIB:.1f} GiB |",
        f"| disk | {m['disk']} |",
        f"| uname | {m['uname']} |",
        f"| software | Python {m['python']}, {m['versions']}, reshard {m['commit']} |",
        f"| page cache | {r.get('cache', '')} |",
        f"| load average | {r['load_start'][0]:.1f} at the start, {r['load_end'][0]:.1f} at the end "
        "(1-minute; other jobs share this machine, so single runs are noisy: read the medians and ratios) |",
        "",
    ]


def _disk(r: dict) -> list[str]:
    speed = {k: f"{v:.2f} GB/s" if v else "O_DIRECT refused" for k, v in r["disk"].items()}
    return [
        "## 0. The disk",
        "",
        f"Its own sequential speeds with the page cache bypassed (O_DIRECT, 16 MiB requests): reading the llama "
        f"checkpoint {speed['read']}, writing 2 GB and fsync {speed['write']}. A save reads and writes every byte "
        "once on this one disk, so its floor is about size / read + size / write when reads and writes take "
        "turns, size / max(read, write) when the device overlaps them.",
        "",
    ]


def _compare(r: dict) -> list[str]:
    L: list[str] = []
    d = r.get("disk")
    for i, c in enumerate(r.get("compare", [])):
        ck, state = c["checkpoint"], c.get("state", "dropped")
        if i == 0:
            L += [
                f"## 1. `reshard save --tp {c['tp']}` vs `cp -r`",
                "",
                f"{r.get('reps', len(c['rows']['reshard save']['seconds']))} interleaved rounds per table; every timed "
                "command is followed by `sync` (reshard fsyncs its files itself), so buffered writes count. *dropped*: "
                "page cache dropped before each run; *warm*: the source read into it first. *CPU s/GB*: the child's "
                "user + sys seconds (rusage) per GB written. *reshard / this*: median over rounds of reshard's time "
                "divided by this command's time in the same round (< 1: reshard is faster). Default checksum "
                "(BLAKE3) on.",
                "",
            ]
        disk = ""
        if d and d.get("read") and d.get("write"):
            floor = ck["bytes"] / GB / d["read"] + ck["bytes"] / GB / d["write"]
            disk = f" Disk floor (read + write, O_DIRECT): {floor:.2f} s."
        L += [
            f"**{ck['arch']}, {state}**: {ck['bytes'] / GB:.2f} GB, {ck['layers']} layers, {ck['tensors']} tensors "
            f"in {ck['shards']} shards; largest tensor {ck['largest_tensor']} ({ck['largest_tensor_bytes'] / GB:.2f} "
            f"GB).{disk if state == 'dropped' else ''}",
            "",
            "| command | median s | runs s | GB/s | CPU s (user+sys) | CPU s/GB | peak RSS | reshard / this |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
            *[
                f"| {name} | {_median_runs(row['median'], row['seconds'])} | "
                f"{row['gbps']:.2f} | {row['cpu']:.1f} | {_cpu_per_gb(row, ck):.2f} | {fmt_b(row['rss'])} | "
                f"{row['reshard_over']:.2f} |"
                for name, row in c["rows"].items()
            ],
            "",
        ]
    return L


def _cpu_per_gb(row: dict, ck: dict) -> float:
    """A compare row's CPU seconds per GB written (results from before cpu_per_gb was stored: from cpu)."""
    return row.get("cpu_per_gb", row["cpu"] / (ck["bytes"] / GB))


def _median_runs(median: float, runs: list[float]) -> str:
    """A row's "median s | runs s" cells."""
    return f"{fmt_s(median)} | {' '.join(fmt_s(x) for x in runs)}"


def _section(heading: str, text: str, columns: str, align: str, rows: list[str]) -> list[str]:
    """A section of the report: its heading, a paragraph, then a table (its header, alignment row and rows)."""
    return [heading, "", text, "", columns, align, *rows, ""]


def _rss(r: dict) -> list[str]:
    return _section(
        f"## 2. Peak RSS of `reshard save --tp {r['rss'][0]['tp']}`",
        f"Peak resident memory of the process (`/usr/bin/time` %M); the machine has {r['machine']['ram'] / GIB:.1f} "
        "GiB. The buffers are bounded by the executor's max_memory (default 512 MiB), not by tensor or file sizes.",
        "| checkpoint | size | largest tensor | time s | GB/s | peak RSS |",
        "|---|---:|---:|---:|---:|---:|",
        [
            f"| {ck['arch']}, {ck['layers']} layers | {ck['bytes'] / GB:.2f} GB | "
            f"{ck['largest_tensor_bytes'] / GB:.2f} GB ({ck['largest_tensor']}) | {fmt_s(x['seconds'])} | "
            f"{ck['bytes'] / x['seconds'] / GB:.2f} | {fmt_b(x['rss'])} |"
            for x in r["rss"]
            for ck in [x["checkpoint"]]
        ],
    )


def _per_rank(r: dict) -> list[str]:
    pr = r["per_rank"]
    ck = pr["checkpoint"]
    return _section(
        f"## 3. One rank's load (rank 0 of {pr['tp']})",
        f"Rank 0 needs {pr['rank_bytes'] / GB:.3f} GB of tensors (1/{pr['tp']} of {ck['bytes'] / GB:.2f} GB is "
        f"{ck['bytes'] / pr['tp'] / GB:.3f} GB; replicated whole tensors: {pr['replicated_bytes'] / 2**20:.2f} MiB). "
        "Bytes read: `read_bytes` of /proc/self/io, from a dropped page cache (kernel read-ahead included). "
        "Each variant runs in its own process; medians of interleaved runs. safetensors maps the file, so "
        "narrowing a `get_tensor` result reads only the pages it touches: a row split reads about 1/T of a "
        "tensor, a column split (o_proj, down_proj) all of it; hence well under the whole checkpoint, "
        "but several times what one rank needs.",
        "| how | median s | runs s | bytes read | of the checkpoint |",
        "|---|---:|---|---:|---:|",
        [
            f"| {name} | {_median_runs(row['median'], row['seconds'])} | "
            f"{row['read_bytes'] / GB:.3f} GB | {row['read_bytes'] / ck['bytes']:.3f} |"
            for name, row in pr["rows"].items()
        ],
    )


def _vllm(r: dict) -> list[str]:
    v, ck = r["vllm"], r["vllm"]["checkpoint"]
    return _section(
        f"## 4. vLLM (CPU build) weight loading at T={v['tp']}",
        f"{ck['arch']}, {ck['layers']} layers, {ck['bytes'] / GB:.2f} GB; `LLM(..., tensor_parallel_size={v['tp']}, "
        "enforce_eager=True, max_model_len=256, skip_tokenizer_init=True)` with VLLM_CPU_KVCACHE_SPACE=1 "
        "VLLM_CPU_OMP_THREADS_BIND=nobind, page cache dropped before each engine. *weights*: the largest "
        '"Loading weights took X seconds" its workers log; *engine*: LLM() construction, start to ready. '
        f"Measured on {r['started']} (a run that skips this section keeps this text, date and all).",
        "| loader | weights s (median) | runs s | engine s (median) |",
        "|---|---:|---|---:|",
        [
            f"| {name} | {_median_runs(row['weights_med'], row['weights'])} | {fmt_s(row['ready_med'])} |"
            for name, row in v["rows"].items()
        ],
    )


def _plan(r: dict) -> list[str]:
    return _section(
        "## 5. Planning time",
        "`build_plan` at TP 8 from the headers alone (tests/fixtures/synthetic.py: the real models' tensor names, "
        "shapes and dtypes, every layer; no byte read), best of 3 in this process.",
        "| model | output tensors | wall s | CPU s |",
        "|---|---:|---:|---:|",
        [f"| {x['model']} | {x['tensors']} | {x['seconds']:.2f} | {x['cpu']:.2f} |" for x in r["plan"]],
    )


def _how() -> list[str]:
    return [
        "## How `reshard save` gets there",
        "",
        "- Reader threads read source row chunks (32 MiB) ahead, in the order the plan will use them, into reused "
        "buffers; four reads in flight also keep the disk busy through an MoE's thousands of small tensors. A "
        "source file in the page cache is copied out of it; one that is not (16 pages sampled) is read with "
        "O_DIRECT, which spares the kernel's allocation and copy of every page (*dropped* vs *warm* CPU s/GB).",
        "- The main thread hands every rank views of the rows it needs: no copies, no whole tensors.",
        "- Per output file, a writer thread hashes (BLAKE3, about twice sha256's speed per core) and an I/O thread "
        "writes with O_DIRECT: no page-cache copy and no dirty-page throttling. Contiguous pieces (row splits, "
        "whole experts, replicated tensors) of 1 MiB and more go to disk straight from the read buffer: the "
        "headers are padded so that most of a file's tensors start on a page, as they lie in the buffers. Smaller "
        "ones from 64 KiB (an MoE's experts at TP 8) that line up with their file are held, not copied, and "
        "written with the stage in one vectored write. Column splits, small pieces and pieces off a page boundary "
        "(O_DIRECT reads keep a tensor's page offset in the source) are gathered into 4 MiB aligned stages (the "
        "one copy they need).",
        "- Memory: the executor's max_memory (default 512 MiB) of reused buffers plus 8 MiB per open output file, "
        "whatever the checkpoint or tensor size.",
        "- What bounds it: the disk, which serves the reads and the writes (every byte is read once and written "
        "once). Its CPU per GB: the hash, the kernel's copy of each source byte out of the page cache (warm) or "
        "the gathering of pieces that O_DIRECT reads leave off a page boundary (dropped), the kernel's I/O, and "
        "Python's per-piece work, which MoE checkpoints' thousands of small tensors multiply.",
        "",
    ]


def _notes(notes: list[str]) -> list[str]:
    return ["## Notes", "", *[f"- {n}" for n in notes], ""] if notes else []


def _commands(r: dict) -> list[str]:
    return [
        "## Commands",
        "",
        "```",
        *sorted({cmd for c in r.get("compare", []) for cmd in c["commands"].values()}),
        "```",
        "",
        "`_naive` is scripts/bench.py's naive script: for each rank, `safetensors.torch.load_file` every shard, "
        "slice with torch as reshard's plan says, `save_file`. Raw numbers: build/bench/results.json. Re-run "
        "with `make bench` (the full benchmark) or `python -m scripts.bench --report-only` (rewrite this file "
        "from build/bench/results.json).",
        "",
    ]


def targets(r: dict) -> list[str]:
    """The Targets table: each measured figure against its goal, met or not."""
    out = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for c in r.get("compare", []):
        rows, ck, state = c["rows"], c["checkpoint"], c.get("state", "dropped")
        cp = rows["cp -r"]["reshard_over"]
        limit = 0.9 if state == "dropped" else 1.0
        out.append(
            f"| save --tp {c['tp']} / (cp -r + sync) <= {limit} ({ck['arch']}, {ck['bytes'] / GB:.1f} GB, {state}) | "
            f"{cp:.2f} | {'yes' if cp <= limit else 'no'} |"
        )
        per_gb = _cpu_per_gb(rows["reshard save"], ck)
        met = "yes" if per_gb <= 0.8 else "no"
        out.append(f"| CPU s per GB written <= 0.8 ({ck['arch']}, {state}) | {per_gb:.2f} | {met} |")
        if "naive script" in rows:
            x = 1 / rows["naive script"]["reshard_over"]
            out.append(
                f"| >= 3x faster than the naive script ({ck['arch']}) | {x:.1f}x | {'yes' if x >= 3 else 'no'} |"
            )
    rss = r.get("rss") or []
    if len(rss) >= 2:
        lo, hi = min(x["rss"] for x in rss), max(x["rss"] for x in rss)
        sizes = " / ".join(f"{x['checkpoint']['bytes'] / GB:.0f} GB: {fmt_b(x['rss'])}" for x in rss)
        ok = hi <= 1.5 * GIB and hi <= 1.25 * lo + 64 * 2**20
        out.append(f"| peak RSS flat (and <= 1.5 GiB) | {sizes} | {'yes' if ok else 'no'} |")
    pr = r.get("per_rank")
    if pr:
        row = pr["rows"]["reshard rank files (safe_open + get_tensor)"]
        want = pr["checkpoint"]["bytes"] / pr["tp"] + pr["replicated_bytes"]
        ok = row["read_bytes"] <= want * 1.05 + 16 * 2**20
        out.append(
            f"| one rank reads 1/T + replicated ({want / GB:.3f} GB) | {row['read_bytes'] / GB:.3f} GB | "
            f"{'yes' if ok else 'no'} |"
        )
    return [*out, ""]


def previous(path: Path) -> str:
    """The report `path` holds now, whose skipped sections a rewrite keeps ("" where there is none)."""
    return path.read_text() if path.exists() else ""


def keep_hub_section(path: Path, text: str) -> str:
    """`text` with the hub section (`python -m scripts.bench hub`) that `path` holds kept at its end."""
    old = path.read_text() if path.exists() else ""
    return text.rstrip("\n") + "\n\n" + old[old.index(MARK) :] if MARK in old else text
