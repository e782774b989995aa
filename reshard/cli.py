"""The `reshard` command: a thin root that maps errors to one line and a documented exit code."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import sys
import traceback
from typing import NoReturn

import click

from reshard import __version__, settings
from reshard.console import keep_notes, kept_notes, release_notes
from reshard.errors import (
    CorruptError,
    ExitCode,
    OutputError,
    ReshardError,
    SourceError,
    StdoutUnwritable,
    UnsupportedError,
    UsageError,
    memory_refused,
    printable,
)


class _StdoutClosed(Exception):
    """Whoever reads stdout closed it (`reshard verify OUT | head -1`)."""


STDOUT_CLOSED = 141  # as a shell reports a process that SIGPIPE ended: 128 + 13


class _Interrupted(BaseException):
    """Ctrl-C or SIGTERM during a command. Not a KeyboardInterrupt: click would catch that and write
    a blank line to stderr first (to close a terminal's `^C` echo), and an error is one line; that
    blank line is written here, on a terminal only."""


class _Root(click.Group):
    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        try:  # the root's --help and --version print here, before invoke
            return super().make_context(info_name, args, parent, **extra)
        except OSError as e:
            _raise_stdout_error(e)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # not through click's catch, which writes a blank line first
            raise _Interrupted from None
        except OSError as e:
            _raise_stdout_error(e)


def _raise_stdout_error(e: OSError) -> NoReturn:
    """An OSError out of click: a stdout closed by its reader ends quietly (click would turn it into a
    silent exit 1); help or --version that click.echo cannot write is an unwritable stdout (exit 5);
    any other error is the command's own, raised as it is."""
    if e.errno == errno.EPIPE:
        if _stdout_closed():
            raise _StdoutClosed from None
        raise RuntimeError(f"broken pipe: {e}") from e
    if any(frame.f_code is click.utils.echo.__code__ for frame, _ in traceback.walk_tb(e.__traceback__)):
        raise StdoutUnwritable(e) from e
    raise e


def _stdout_closed() -> bool:
    """Whether the reading end of stdout is gone (poll reports an error on the writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, ValueError, OSError):
        return False


def _end_quietly() -> None:
    """Nothing more can be shown: stdout goes nowhere from now on (no error at exit's flush)."""
    _discard(sys.stdout)
    sys.exit(STDOUT_CLOSED)


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="reshard")
def cli() -> None:
    """Pre-shard Hugging Face checkpoints for vLLM tensor-parallel serving.

    \b
    reshard save --tp 8 Qwen/Qwen3-235B-A22B-FP8 out/   write every rank's files
    reshard plan --tp 8 Qwen/Qwen3-235B-A22B-FP8        per-GPU tensors and bytes, nothing written
    reshard verify out/                                 check an output before it ships
    reshard save out/ out-tp4/ --tp 4                   re-shard an output, no original needed
    reshard merge out/ hf/                              back to a Hugging Face checkpoint
    vllm serve out/ --load-format sharded_state -tp 8

    Exit codes: 0 ok, 1 internal error (a bug), 2 usage, 3 unsupported model or layout, 4 bad
    source, 5 output refused (not empty, disk full, locked by another run), 6 verify: layout
    differs, 7 verify: corrupt or incomplete, 130 interrupted. Errors are one line on stderr,
    `reshard: error: ...`; with --json a failing command also prints {"ok": false, "error": {...}}
    on stdout. A stdout closed by its reader (`reshard verify OUT | head -1`) ends the command
    quietly with 141, as SIGPIPE would.

    \b
    Environment (a value not accepted is a usage error, exit 2):
      RESHARD_DEBUG=1             show the traceback of an error
      RESHARD_DISABLE_PROGRESS=1  no progress output on stderr (also: --json, NO_COLOR only colours)
      RESHARD_O_DIRECT=0          buffered writes instead of O_DIRECT (for filesystems that mis-handle it)
      RESHARD_DIRECT_READS=auto   O_DIRECT reads of files not in the page cache (sources, files verified or served; 1: all, 0: none)
      RESHARD_HUB_CONNECTIONS=8   repo ids: HTTP connections at once
      RESHARD_HUB_RETRIES=8       repo ids: retries of a failing request without progress
      RESHARD_HUB_BACKOFF=0.5     repo ids: first wait before a retry, seconds (doubled each time)
      RESHARD_HUB_TIMEOUT=60      repo ids: seconds without a byte before a request fails
      RESHARD_HUB_MIN_SPEED=65536 repo ids: a body slower than this (bytes/s) after its first timeout is retried
      RESHARD_HUB_SMALL=1048576   repo ids: smaller neighbouring tensors fetched together (0: never)
      RESHARD_STREAM_SPILL=8589934592  --stream: bytes read ahead of the sha256 kept on disk (TMPDIR), not fetched twice
      RESHARD_S3_CONCURRENCY=8    s3://: parts uploaded at once
      RESHARD_S3_PART_SIZE=16777216  s3://: bytes per uploaded part (at least 5 MiB)
      RESHARD_S3_RETRIES=8        s3://: retries of a failing request (throttling, dropped connections)
      RESHARD_S3_TIMEOUT=60       s3://: seconds without progress before a request fails
      HF_HOME, HF_HUB_OFFLINE, HF_TOKEN, HF_ENDPOINT   as for huggingface_hub (Hub repo ids)
      AWS_ENDPOINT_URL, AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_REGION, ...   as for the aws CLI (s3://)
    """


def _register() -> None:
    from reshard.commands.assemble import assemble_cmd
    from reshard.commands.merge import merge_cmd
    from reshard.commands.plan import plan_cmd
    from reshard.commands.save import save_cmd
    from reshard.commands.verify import verify_cmd

    cli.add_command(save_cmd)
    cli.add_command(plan_cmd)
    cli.add_command(verify_cmd)
    cli.add_command(merge_cmd)
    cli.add_command(assemble_cmd)


_register()


_HELP = frozenset(("-h", "--help", "--version"))


def _on_signal(signum: int, frame: object) -> None:
    raise _Interrupted


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str] | None = None) -> None:
    before = {s: signal.getsignal(s) for s in _SIGNALS}
    signal.signal(signal.SIGTERM, _on_signal)  # SIGTERM ends a run as Ctrl-C does
    if before[signal.SIGHUP] == signal.SIG_DFL:  # a terminal or ssh closed (not under nohup)
        signal.signal(signal.SIGHUP, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        _main(argv)
    finally:  # as they were (a caller's own Ctrl-C: tests run commands in their process)
        for s, handler in before.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(s, handler)


def _main(argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in args
    keep_notes(as_json)  # under --json, `note:` lines go into the JSON object (`notes`), not on stderr
    debug = False
    if (publish := sys.modules.get("reshard.publish")) is not None:
        publish.forget()  # an earlier run in this process (tests): what it published is not this run's
    try:
        debug = settings.DEBUG.get()
        if not _HELP.intersection(args):  # help and --version work whatever the environment holds
            settings.check_all()  # a bad RESHARD_* value fails here, before the command starts
        rc = cli.main(args=args, prog_name="reshard", standalone_mode=False)
    except _StdoutClosed:
        _end_quietly()
    except StdoutUnwritable as e:
        _unwritable(e, args)
    except (click.exceptions.Abort, KeyboardInterrupt, _Interrupted):
        for s in _SIGNALS:  # a second Ctrl-C (a double press) while the line is written: ignored
            signal.signal(s, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            if sys.stderr.isatty():
                print(file=sys.stderr)  # off the line a terminal's `^C` echo left
        _interrupted(as_json, args[0] if args else "")
    except click.exceptions.NoArgsIsHelpError as e:  # bare `reshard`: the help laid out, on stderr; exit 2
        print(e.format_message(), file=sys.stderr, flush=True)
        sys.exit(int(ExitCode.USAGE))
    except click.UsageError as e:
        where = "reshard" + (f" {args[0]}" if args and args[0] in cli.commands else "")
        _fail(f"{e.format_message()} (see `{where} --help`)", ExitCode.USAGE, as_json, USAGE_KIND)
    except click.ClickException as e:
        _fail(e.format_message(), e.exit_code, as_json, USAGE_KIND)
    except ReshardError as e:
        if debug:  # the traceback too; the error, its code and --json's object as ever
            traceback.print_exc()
        _fail(str(e), e.exit_code, as_json, _kind(e))
    except Exception as e:
        if debug:
            traceback.print_exc()
        if memory_refused(e):  # a ulimit -v, a container's limit (numpy's or torch's library not mapped too)
            _fail(OUT_OF_MEMORY, ExitCode.BAD_OUTPUT, as_json, "OutputError")
        msg = f"internal error: {type(e).__name__}: {e} (rerun with RESHARD_DEBUG=1 and report it)"
        _fail(msg, ExitCode.INTERNAL, as_json, "InternalError")
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _end_quietly()
    except OSError as e:
        _unwritable(StdoutUnwritable(e), args)
    sys.exit(rc if isinstance(rc, int) else 0)


def _unwritable(e: StdoutUnwritable, args: list[str]) -> None:
    """stdout cannot be written: its result is lost, said on stderr (no --json object: stdout is the problem),
    after the notes the lost --json object held (`note:` lines, as without --json)."""
    _discard(sys.stdout)  # no second failure at exit's flush
    release_notes(e.notes)
    writes = args[:1] in (["save"], ["merge"], ["assemble"]) and not _HELP.intersection(args)  # help: it never ran
    done = " (the command itself had finished: `reshard verify` the output it wrote)" if writes else ""
    failed = f"; the command had failed: {e.failed}" if e.failed else ""  # as a --json failure's object lost
    _fail(f"cannot write the result to stdout: {e}{failed}{done}", ExitCode.BAD_OUTPUT, False, "OutputError")


_READ_ONLY = frozenset(("verify", "plan"))  # commands that write nothing


def _interrupted(as_json: bool, command: str) -> None:
    """Exit 130 saying what is on disk: the interrupt may have come once this run had published
    (checked again now: the folder holds the files this run put there)."""
    from reshard.publish import published

    if command in _READ_ONLY:
        _fail(
            f"interrupted; {command} writes nothing, so nothing changed", ExitCode.INTERRUPTED, as_json, "interrupted"
        )
    done = published()
    if done:
        msg = f"interrupted after publishing: {'; '.join(done)} (`reshard verify` it)"
        _fail(msg, ExitCode.INTERRUPTED, as_json, "interrupted_after_publishing")
    msg = "interrupted; nothing was published and a previous output is unchanged"
    _fail(msg, ExitCode.INTERRUPTED, as_json, "interrupted")


OUT_OF_MEMORY = (
    "out of memory: the process may not take what this run needs (a `ulimit -v`, or the container's limit) "
    "(lower --max-memory, default 512MiB, or raise the limit)"
)
USAGE_KIND = "UsageError"  # every exit 2 (click's, a bad RESHARD_* value, ...): one kind a CI job can match
_KINDS = (UsageError, UnsupportedError, SourceError, OutputError, CorruptError)  # one kind per exit code


def _kind(e: ReshardError) -> str:
    """--json's error.kind: the documented class of the error, not a subclass's name."""
    return next((k.__name__ for k in _KINDS if isinstance(e, k)), type(e).__name__)


def _fail(message: str, code: int, as_json: bool, kind: str) -> NoReturn:
    """One line on stderr; with --json also an object on stdout that CI can parse. The exit code is
    the one thing sure to arrive: a stream that cannot be written changes neither it nor the other."""
    message = " ".join(printable(message).split())  # one line, a path's control characters escaped
    if as_json:
        err = {"code": int(code), "kind": kind, "message": message}
        notes = kept_notes()  # what it said before it failed (hashing a source, a lock left behind, ...)
        try:
            print(json.dumps({"ok": False, "error": err, **({"notes": notes} if notes else {})}), flush=True)
        except BrokenPipeError:  # stdout closed by its reader: stderr still tells, notes first as without --json
            _discard(sys.stdout)
            release_notes(notes)
        except OSError as e:  # a full disk: the object CI would parse is lost, which stdout's code says
            _discard(sys.stdout)
            release_notes(notes)
            message = f"cannot write the result to stdout: {e.strerror or e}; the command had failed: {message}"
            code = ExitCode.BAD_OUTPUT
    try:
        print(f"reshard: error: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed by its reader or on a full disk: the exit code still tells
        _discard(sys.stderr)
    sys.exit(int(code))


def _discard(stream: object) -> None:
    """A stream that failed goes to /dev/null from now on: what it still buffers cannot fail again at
    exit's flush (Python would then exit 120)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()  # type: ignore[attr-defined]
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
