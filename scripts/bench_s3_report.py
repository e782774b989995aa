"""docs/benchmarks.md's section 7 (saving to object storage) from scripts/bench_s3.py's results: `section`
renders it, with its targets; `splice` puts it into an existing docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

from scripts.benchlib import GB, GIB, fmt_b, fmt_s, med

HEAD = "## 7. Saving to object storage"


def _disk(n: float) -> str:
    return fmt_b(n) if n >= 2**20 else f"{n / 1024:.0f} KiB"


def _runs(xs: list[dict]) -> str:
    return f"{fmt_s(med([x['seconds'] for x in xs]))} ({' '.join(fmt_s(x['seconds']) for x in xs)})"


def section(r: dict) -> list[str]:
    """The section of docs/benchmarks.md (scripts/bench_report.py renders it from results.json)."""
    alone = f", {r['started']} by `python -m scripts.bench s3 {' '.join(r['argv'])}`" if "argv" in r else ""
    L = [
        f"{HEAD} (`reshard save ... s3://bucket/prefix/ --tp {r['tp']}`)",
        "",
        "A local SeaweedFS (tests/fixtures/s3server.py: `weed mini` on 127.0.0.1, plain http, its data on this "
        f"disk) is the bucket; part size {fmt_b(r['part_size'])}, {r['concurrency']} parts at once "
        f"(RESHARD_S3_PART_SIZE, RESHARD_S3_CONCURRENCY), {r['reps']} interleaved rounds, load "
        f"{r['load_start'][0]:.1f} at the start, {r['load_end'][0]:.1f} at the end{alone}. The store runs on the "
        "same 2 cores as the client: read the ratios. Ratios are medians of per-round ratios.",
        "",
    ]
    u = r.get("upload")
    if u:
        L += [
            f"**save vs upload** ({u['bytes'] / GB:.2f} GB synthetic Llama, source in the page cache): "
            "`reshard save SRC s3://` against uploading the folder a local `reshard save` wrote, with reshard's "
            "client, part size and concurrency (s3transfer's TransferManager, as boto3's upload_file and "
            "`aws s3 cp --recursive`; every file submitted at once, each part's SHA256 sent for the store to check).",
            "",
            "| command | wall s (median, runs) | CPU s (median) | CPU s/GB | peak RSS |",
            "|---|---|---:|---:|---:|",
            *[
                f"| {name} | {_runs(xs)} | {med([x['cpu'] for x in xs]):.1f} | "
                f"{med([x['cpu'] for x in xs]) / (u['bytes'] / GB):.2f} | {fmt_b(max(x['rss'] for x in xs))} |"
                for name, xs in u["runs"].items()
            ],
            "",
            "Commands: " + "; ".join(f"{k}: `{v}`" for k, v in u["commands"].items()) + ".",
            "",
        ]
    h = r.get("hub")
    if h:
        L += [
            f"**Hub -> S3** ({h['bytes'] / GB:.2f} GB from tests/fixtures/hubserver.py, {h['rate'] / 1e6:.0f} MB/s "
            "per response): `--stream` straight to the bucket against the three steps by hand. *local disk*: "
            "peak allocated blocks under the run's folder (HF_HOME, TMPDIR, XDG_CACHE_HOME, the local output), "
            "polled every 0.1 s. The stream can be no faster than its slowest side, so the ratio is at least "
            "upload / (download + save + upload): with a Hub much faster than the bucket it tends to 1; --rate "
            "caps each response, as a CDN's per-connection speed does (`hf download` fetches each file on one "
            "connection, reshard ranges on RESHARD_HUB_CONNECTIONS).",
            "",
            "| variant | wall s (median, runs) | steps s (median) | peak RSS | local disk peak |",
            "|---|---|---|---:|---:|",
            *[
                f"| {name} | {_runs(xs)} | "
                + ", ".join(f"{k} {fmt_s(med([x['steps'][k]['seconds'] for x in xs]))}" for k in xs[0]["steps"])
                + f" | {fmt_b(max(x['rss'] for x in xs))} | {_disk(max(x['disk_peak'] for x in xs))} |"
                for name, xs in h["runs"].items()
            ],
            "",
            "Commands: " + "; ".join(f"{k}: `{v}`" for k, v in h["commands"].items()) + ".",
            "",
        ]
    if r.get("rss"):
        L += [
            "**Peak RSS** of `reshard save SRC s3://` (`/usr/bin/time` %M): at most RESHARD_S3_CONCURRENCY parts "
            "in flight plus one part buffer per open file, beside the executor's buffers.",
            "",
            "| checkpoint | wall s | GB/s | peak RSS |",
            "|---|---:|---:|---:|",
            *[
                f"| {x['checkpoint']['bytes'] / GB:.2f} GB llama | {fmt_s(x['seconds'])} | "
                f"{x['checkpoint']['bytes'] / x['seconds'] / GB:.2f} | {fmt_b(x['rss'])} |"
                for x in r["rss"]
            ],
            "",
        ]
    return [*L, *targets(r), ""]


def targets(r: dict) -> list[str]:
    def met(ok: bool) -> str:
        return "yes" if ok else "no"

    out = ["| target | measured | met |", "|---|---|---|"]
    if r.get("upload"):
        x = r["upload"]["ratio"]
        out.append(f"| save to s3:// / upload of the saved folder <= 1.1 | {x:.2f} | {met(x <= 1.1)} |")
    if r.get("hub"):
        h = r["hub"]
        x = h["ratio"]
        out.append(f"| Hub -> S3 --stream / (hf download + save + upload) <= 0.5 | {x:.2f} | {met(x <= 0.5)} |")
        disk = max(s["disk_peak"] for s in h["runs"]["--stream to s3://"])
        out.append(
            f"| Hub -> S3 --stream local disk < 1% of the checkpoint ({fmt_b(0.01 * h['bytes'])}) | {_disk(disk)} | "
            f"{met(disk < 0.01 * h['bytes'])} |"
        )
    if len(r.get("rss") or []) >= 2:
        rss = [x["rss"] for x in r["rss"]]
        sizes = " / ".join(f"{x['checkpoint']['bytes'] / GB:.0f} GB: {fmt_b(x['rss'])}" for x in r["rss"])
        ok = max(rss) <= GIB and max(rss) <= 1.25 * min(rss) + 64 * 2**20
        out.append(f"| save to s3:// peak RSS flat and <= 1 GiB | {sizes} | {met(ok)} |")
    return out


def splice(doc: Path, lines: list[str]) -> None:
    """Put the section into `doc` in place of an earlier one, else before `## Targets`."""
    text = doc.read_text()
    new = "\n".join(lines).rstrip("\n") + "\n\n"
    if HEAD in text:
        start = text.index(HEAD)
        end = text.index("\n## ", start) + 1
    else:
        start = end = text.index("## Targets")
    doc.write_text(text[:start] + new + text[end:])
