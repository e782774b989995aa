"""Scratch files outside OUT_DIR (reshard.scratch): a later run removes those a killed run left, and only those."""

from __future__ import annotations

import subprocess
import sys

from reshard.names import SCRATCH_DIR_GLOB
from reshard.scratch import owner, sweep


def test_only_what_ended_runs_of_this_machine_left_is_removed(tmp_path):
    """Removed: a run's that ended, one whose pid now names another process (another start time). Kept: this
    run's, another machine's or pid namespace's (a shared cache, another container's /tmp), a name with no owner."""
    code = "from reshard.scratch import owner; print(owner())"
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    machine, pid, start = owner().split("-")
    names = {
        ended: False,
        f"{machine}-{pid}-{int(start) + 1}": False,  # this pid, another start: the pid was used again
        owner(): True,
        f"{'0' * len(machine)}-{pid}-{start}": True,
        f"{'0' * len(machine)}-{ended.split('-', 1)[1]}": True,
    }
    for token in names:
        (tmp_path / f"blob.{token}.0badf00d.reshard-refetch").write_bytes(b"x")
        (tmp_path / f"reshard-side.{token}.xyz").mkdir()
        (tmp_path / f"reshard-side.{token}.xyz" / "config.json").write_bytes(b"{}")
    (tmp_path / "blob.0badf00d.reshard-refetch").write_bytes(b"x")  # reshard < this: no owner, left
    (tmp_path / "reshard-side-abc").mkdir()
    sweep(tmp_path, "*.reshard-refetch")
    sweep(tmp_path, SCRATCH_DIR_GLOB)
    kept = {t for t, keep in names.items() if keep}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"blob.{t}.0badf00d.reshard-refetch" for t in kept]
        + [f"reshard-side.{t}.xyz" for t in kept]
        + ["blob.0badf00d.reshard-refetch", "reshard-side-abc"]
    )
