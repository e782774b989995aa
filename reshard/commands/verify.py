"""`reshard verify OUT_DIR` (placeholder until the verify module lands)."""

from __future__ import annotations

import click


@click.command("verify")
@click.argument("out_dir")
def verify_cmd(out_dir):
    """Check an output folder against its manifest."""
    raise click.UsageError("verify is not implemented yet")
