"""The `reshard` command: a thin root that maps errors to one line and a documented exit code."""

from __future__ import annotations

import os
import signal
import sys

import click

from reshard import __version__
from reshard.errors import ExitCode, ReshardError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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

    Exit codes: 0 ok, 1 internal error, 2 usage, 3 unsupported model or layout, 4 bad source,
    5 output refused (not empty, disk full), 6 verify: layout differs, 7 verify: corrupt or
    incomplete, 130 interrupted. RESHARD_DEBUG=1 shows tracebacks.
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


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    debug = os.environ.get("RESHARD_DEBUG", "").lower() in ("1", "true", "yes")
    try:
        rc = cli.main(args=argv, prog_name="reshard", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("interrupted; partial output removed", ExitCode.INTERRUPTED)
    except KeyboardInterrupt:
        _fail("interrupted; partial output removed", ExitCode.INTERRUPTED)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except ReshardError as e:
        if debug:
            raise
        _fail(str(e), e.exit_code)
    except Exception as e:
        if debug:
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (rerun with RESHARD_DEBUG=1 and report it)", ExitCode.INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)


def _fail(message: str, code: int) -> None:
    print(f"reshard: error: {message}", file=sys.stderr, flush=True)
    sys.exit(int(code))
