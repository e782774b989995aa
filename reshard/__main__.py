"""`python -m reshard` and the `reshard` command: import the CLI with Ctrl-C already meaning exit 130.

A signal that arrives while the modules are still being imported would otherwise print a traceback.
"""

import _signal  # signal's C half: set from an except clause with no Python frame a second Ctrl-C could enter
import contextlib
import errno
import io
import os
import sys


class ClosedStdout(io.TextIOBase):
    """sys.stdout of a process started with stdout closed (`>&-`): writing a result fails as writing
    to a closed descriptor does (EBADF), which the CLI tells as an unwritable stdout (exit 5): a
    result no one can see is never a success."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "it was closed when reshard started")


def hold_closed_streams() -> None:
    """stdout or stderr closed at start (`>&-`, `2>&-`; Python then sets sys.stdout / sys.stderr to
    None): their descriptors get /dev/null, so that no file this run opens takes number 1 or 2 and
    receives what is meant for them. A closed stderr then drops logs and progress (print(file=None)
    would write them to stdout, into a --json document); a closed stdout fails a result (ClosedStdout)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is not None:
            continue
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)
        setattr(sys, name, ClosedStdout() if fd == 1 else open(fd, "w", closefd=False))  # noqa: SIM115


OUT_OF_MEMORY_AT_START = (
    "out of memory while starting: the memory limit (a `ulimit -v`, or the container's limit) does not leave "
    "room to load reshard's modules (numpy's libraries); raise the limit"
)


def _numpy_loads() -> bool:
    """Under an address-space limit (`ulimit -v`, RLIMIT_DATA), whether numpy can be loaded: OpenBLAS,
    loaded with it, ends the process with exit 1 from C when its buffer is refused, which no Python code
    can catch. A forked child, at the same point, tries first; a Python error it meets is left to this
    process, which then meets it too. Without such a limit there is nothing to try."""
    import resource

    if "numpy" in sys.modules or all(
        resource.getrlimit(r)[0] == resource.RLIM_INFINITY for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA)
    ):
        return True
    pid = os.fork()
    if pid == 0:  # the child: silent, and never past this block
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import numpy
        finally:
            os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        return False
    import numpy  # noqa: F401  here, as in the child: with the same memory left

    return True


def _signals_ignored() -> None:
    """The run is over (its last line printed, or about to be): a Ctrl-C or SIGTERM from here on changes
    nothing. Ignored, a second one can neither end an error line half-written with a traceback, nor, once
    Python has put the default action back, kill the process (-2, -15) in place of the run's exit code."""
    signals = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
    for signum in signals:
        _signal.signal(signum, _signal.SIG_IGN)
    # and blocked: Python's finalization puts SIG_DFL back in place of SIG_IGN (3.11), and one arriving then
    # would kill the process; a blocked one waits, and is dropped when the process exits
    _signal.pthread_sigmask(_signal.SIG_BLOCK, signals)


def _fail_at_start(message: str, code: int, kind: str) -> None:
    """One line on stderr, under --json also the object on stdout every failure gives (reshard.cli._fail),
    with no more imports than these: the CLI could not be imported. `message` holds no `"` or `\\`."""
    _signals_ignored()  # a second Ctrl-C (a double press) while this is written
    if "--json" in sys.argv[1:]:
        error = '{"code": ' + str(code) + ', "kind": "' + kind + '", "message": "' + message + '"}'
        with contextlib.suppress(OSError, MemoryError):  # stdout closed by its reader: stderr still tells
            print('{"ok": false, "error": ' + error + "}", flush=True)
    with contextlib.suppress(OSError, MemoryError, ValueError):
        print(f"reshard: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run() -> None:
    try:  # from the first line: a Ctrl-C that lands anywhere from here on is exit 130 and one line
        # reshard never multiplies matrices: numpy's OpenBLAS thread pool would only spin on a core
        # the writers need (2.5% of a save's CPU on 2 cores, perf). Before numpy is first imported.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        hold_closed_streams()
        import signal

        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends a run as Ctrl-C does
        if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # SIGHUP too (a closed terminal; not under nohup)
            signal.signal(signal.SIGHUP, signal.default_int_handler)
        if not _numpy_loads():
            _fail_at_start(OUT_OF_MEMORY_AT_START, 5, "OutputError")
        from reshard.bulk import as_command
        from reshard.cli import main

        as_command()  # this process is reshard's own: its metadata may be frozen (reshard.bulk)
    except KeyboardInterrupt:
        _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # first: a second Ctrl-C (a double press) changes nothing
        reads_only = sys.argv[1:2] in (["verify"], ["plan"])  # commands that write nothing
        message = "interrupted" + (
            f" ({sys.argv[1]} writes nothing)"
            if reads_only
            else "; nothing was published and a previous output is unchanged"
        )
        _fail_at_start(message, 130, "interrupted")
    except Exception as e:  # memory refused while importing: numpy's library not mapped, a MemoryError
        try:
            from reshard.errors import memory_refused

            refused = memory_refused(e)
        except MemoryError:
            refused = True
        if not refused:
            raise
        _fail_at_start(OUT_OF_MEMORY_AT_START, 5, "OutputError")
    try:
        main()
    finally:  # the run is over: its output published or refused, its last line printed
        _signals_ignored()


if __name__ == "__main__":
    run()
