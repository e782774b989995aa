"""`reshard verify OUT_DIR`."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import click

from reshard.commands.options import Location, json_option, revision_option
from reshard.console import byte_progress, emit_json, human_bytes, kept_notes, note, stdout
from reshard.errors import ExitCode, StdoutUnwritable, printable

if TYPE_CHECKING:
    from reshard.verify import Report

MAX_LINES = 50  # findings shown in the readable report; --json has them all
PER_KIND = 6  # of one kind


@click.command("verify")
@click.argument("out_dir", type=Location())  # a folder, or s3://bucket/prefix/ (a path: shells complete it)
@click.option(
    "--strict/--lax",
    default=True,
    show_default=True,
    help="strict: any key difference fails (the folder loads with stock --load-format sharded_state). "
    "lax: passes what loads with --load-format reshard --model-loader-extra-config '{\"strict\": false}': "
    "missing keys are warnings (left as initialised); unexpected keys, shapes, dtypes and corruption still fail.",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=None,
    help="Tensor-parallel size you will serve with (default: the recorded one; for a folder "
    "without manifest, guessed from the file names).",
)
@click.option(
    "--ep/--no-ep",
    "ep",
    default=None,
    help="Whether you will serve with --enable-expert-parallel (default: as recorded).",
)
@click.option(
    "--pp",
    type=click.IntRange(min=1),
    default=None,
    help="Pipeline-parallel size you will serve with (default: as recorded).",
)
@click.option(
    "--no-checksums",
    "checksums",
    flag_value=False,
    default=True,
    help="Skip the checksum of every file against the manifest.",
)
@click.option(
    "--against",
    metavar="SOURCE",
    type=Location(),
    help="Derive the expected keys and copied files from this checkpoint (folder or Hub repo id); works on "
    "folders without reshard.json, e.g. written by vLLM's save_sharded_state.",
)
@click.option(
    "--deep",
    is_flag=True,
    help="With --against: regenerate every tensor from SOURCE and compare it byte for byte. On s3://: also "
    "stream every object and hash it against the manifest (default there: the store's checksums, from HEADs).",
)
@revision_option
@json_option
@click.pass_context
def verify_cmd(ctx, out_dir, strict, tp, ep, pp, checksums, against, deep, revision, as_json):
    """Check OUT_DIR (a folder, or s3://bucket/prefix/) before it ships: complete, uncorrupted, and the
    layout vLLM will load.

    \b
    Checks:
      structure  reshard.json valid; every file present, of its size, with a readable header that
                 holds what the manifest says, written by the same run; every rank has files;
                 no stray rank files
      keys       per rank, the keys, dtypes and shapes vLLM's sharded_state loader expects,
                 derived again from config.json and the source headers in the manifest
                 (or from --against SOURCE)
      copied     (--against SOURCE) every copied file (config, tokenizer, ...) is the one a
                 save of SOURCE writes: the manifest's digests cannot tell a swapped file
                 whose digest was rewritten too
      checksums  every file's checksum against the manifest (blake3, or sha256 as it names)
      deep       (--against SOURCE --deep) every byte against what SOURCE produces

    \b
    s3://bucket/prefix/ (endpoint and credentials from AWS_ENDPOINT_URL, AWS_PROFILE, ...):
      the same checks, reading headers with ranged GETs; the listing as vLLM's runai_streamer_sharded
      makes it (over 1000 keys, rank-file keys nested under the prefix, an output above it: errors);
      instead of hashing, each object's SHA256 as the store reports it (HEAD) against the one the
      manifest recorded at upload; --deep streams every object and hashes it too, as verify does
      unasked (a note on stderr says so) for objects whose checksum the store does not report (copied
      to another store, a proxy that strips it) or the manifest lacks. Exit 4: the bucket
      cannot be read (credentials, endpoint, missing bucket).

    Exit codes: 0 ok (warnings allowed), 6 the layout differs from the recorded or asked one
    (missing/unexpected keys, shapes, dtypes, --tp/--pp/--ep), 7 corrupt or incomplete
    (missing manifest or files, truncation, checksum, mixed runs, stray files). 7 wins over 6.
    Also 2 usage, 3 --against SOURCE unsupported (or a scheme other than s3://), 4 --against SOURCE
    (or the bucket) cannot be read, 5 stdout cannot be written, 130 interrupted, 141 stdout closed by
    its reader. The report goes to stdout; a failure also ends with one
    `reshard: error: ...` line on stderr.
    """
    from reshard.store import is_bucket_url
    from reshard.verify import verify

    if deep and not against and not is_bucket_url(out_dir):
        raise click.UsageError("--deep needs --against SOURCE (on a folder; on s3:// it hashes every object)")
    if revision and not against:
        raise click.UsageError("--revision is the revision of --against SOURCE (a Hub repo id): give that too")
    if not is_bucket_url(out_dir):
        out_dir = Path(out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise click.BadParameter(f"Directory '{out_dir}' is a file.", param_hint="'OUT_DIR'")
    t0 = time.monotonic()
    with ExitStack() as stack:
        current: list[ExitStack] = []

        def progress(label: str, total: int):
            # one bar at a time: close the previous phase's bar before opening the next
            if current:
                current.pop().close()
            phase = ExitStack()
            stack.callback(phase.close)
            current.append(phase)
            return phase.enter_context(byte_progress(total, label, quiet=as_json))

        report = verify(
            out_dir,
            strict=strict,
            tp=tp,
            ep=ep,
            pp=pp,
            checksums=checksums,
            against=against,
            deep=deep,
            revision=revision,
            progress=progress,
            note=note,  # on stderr, or kept for --json's `notes`
        )
    seconds = time.monotonic() - t0
    try:
        if as_json:
            obj = report.to_json()
            obj["notes"] = kept_notes()  # report.notes, and any the source of --against made
            obj["seconds"] = round(seconds, 3)
            emit_json(obj)
        else:
            _render(report, seconds)
    except StdoutUnwritable as e:  # the report is lost: the CLI's one line says so, and why verify failed
        e.failed = None if report.ok else _failure(report)
        raise
    except BaseException:  # stdout closed by its reader (141): the verdict still reaches stderr
        if not report.ok:
            _fail_line(report)
        raise
    if not report.ok:
        _fail_line(report)
    ctx.exit(report.exit_code)


def _failure(report: Report) -> str:
    """Why verify failed, in one line: the first error, and how many more."""
    first = report.first_error
    assert first is not None
    rest = len(report.errors) - 1
    more = f" (and {rest} more error(s))" if rest else ""
    what = "corrupt or incomplete" if report.exit_code == ExitCode.CORRUPT else "layout differs"
    return " ".join(printable(f"verify: {what} (exit {report.exit_code}): {first.message}{more}").split())


def _fail_line(report: Report) -> None:
    """A failing verify ends as every failing command does: one line on stderr (the report, on
    stdout, is the result a CI job keeps; this line is what its log shows last)."""
    import sys

    print(f"reshard: error: {_failure(report)}", file=sys.stderr, flush=True)


def _render(report: Report, seconds: float) -> None:
    from rich.markup import escape

    from reshard.verify.report import LAX_LOADER

    if report.layout:
        stdout.print(escape(_title(report)))
    if report.files:
        stdout.print(_files_table(report))
    _print_findings(report)
    lw = report.loads_with
    if lw and not lw["strict"]:
        how = f"`{lw['serve']}`" if lw["serve"] else LAX_LOADER
        stdout.print(escape(f"loads with: {how} (not with stock --load-format sharded_state)"))
    stdout.print(escape(_summary(report, seconds)))


def _title(report: Report) -> str:
    lay = report.layout
    assert lay is not None
    title = f"{report.out_dir}: {lay}"
    if lay.dtype != "auto":
        title += f" dtype={lay.dtype}"
    if report.vllm_versions:
        title += f"  for vLLM {report.vllm_versions}"
    if report.run_id:
        title += f"  run {report.run_id[:12]}"
    if report.source:
        title += f"  against {report.source}"
    return title


def _files_table(report: Report):
    from rich.markup import escape
    from rich.table import Table

    table = Table("file", "pp", "tp", "keys", "bytes", "findings")
    for s in report.files:
        found = report.file_findings(s.name)
        errors = sum(1 for f in found if f.severity == "error")
        warnings = len(found) - errors
        status = (
            "ok"
            if not found
            else ", ".join(
                x for x in (f"{errors} error(s)" if errors else "", f"{warnings} warning(s)" if warnings else "") if x
            )
        )
        table.add_row(
            escape(s.name),
            str(s.pp_rank),
            str(s.tp_rank),
            "-" if s.keys is None else str(s.keys),
            "missing" if s.size is None else human_bytes(s.size),
            status,
        )
    return table


def _print_findings(report: Report) -> None:
    """At most PER_KIND findings of a kind and MAX_LINES in all; the count of the rest."""
    from rich.markup import escape

    shown: dict[str, int] = {}
    hidden = 0
    for f in report.findings:
        shown[f.kind] = shown.get(f.kind, 0) + 1
        if shown[f.kind] > PER_KIND or sum(min(n, PER_KIND) for n in shown.values()) > MAX_LINES:
            hidden += 1
            continue
        stdout.print(escape(f"{f.severity}: [{f.kind}] {f.message}"))
    if hidden:
        more = ", ".join(f"{n - PER_KIND} {k}" for k, n in shown.items() if n > PER_KIND)
        stdout.print(f"... and {hidden} more findings ({more or 'see'} --json lists them all)")


def _summary(report: Report, seconds: float) -> str:
    keys = sum(s.keys or 0 for s in report.files)
    size = sum(s.size or 0 for s in report.files)
    st = report.stats
    speed = []
    if st.get("hash_gb_per_s"):
        speed.append(
            f"{st.get('checksum', 'hash')} {human_bytes(st['hashed_bytes'])} at {st['hash_gb_per_s']:.2f} GB/s"
        )
    if st.get("deep_gb_per_s"):
        speed.append(f"compared {human_bytes(st['compared_bytes'])} at {st['deep_gb_per_s']:.2f} GB/s")
    if st.get("hashed_in_compare_bytes"):
        speed.append(f"{st.get('checksum', 'hash')} of {human_bytes(st['hashed_in_compare_bytes'])} while comparing")
    checked = "+".join(report.checked) or "nothing"
    detail = f"{len(report.files)} files, {keys} keys, {human_bytes(size)}; checked {checked}"
    if speed:
        detail += f" ({', '.join(speed)})"
    detail += f"; {seconds:.1f} s"
    n_err, n_warn = len(report.errors), len(report.warnings)
    if report.ok:
        verdict = "OK" + (f" with {n_warn} warning(s)" if n_warn else "")
        if report.loads_with and not report.loads_with["strict"]:
            verdict += ' (lax: loads only with --load-format reshard and {"strict": false})'

    else:
        what = "corrupt or incomplete" if report.exit_code == ExitCode.CORRUPT else "layout differs"
        verdict = f"FAILED ({what}, exit {report.exit_code}): {n_err} error(s), {n_warn} warning(s)"
    return f"{verdict}: {detail}"
