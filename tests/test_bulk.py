"""reshard.bulk: the collector paused while metadata is built, and frozen only in reshard's own process."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from reshard.bulk import paused_gc


def test_paused_gc_pauses_and_restores_even_on_error():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with pytest.raises(KeyError), paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: still paused inside, still paused after the inner one
            assert not gc.isenabled()
        assert not gc.isenabled()
        raise KeyError("x")
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen, "a library caller's objects were frozen"


def test_paused_gc_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("command", [False, True])
def test_only_reshard_as_its_own_command_freezes(command):
    code = (
        "import gc\n"
        "from reshard import bulk\n" + ("bulk.as_command()\n" if command else "") + "before = gc.get_freeze_count()\n"
        "with bulk.paused_gc():\n"
        "    kept = [[i] for i in range(1000)]\n"
        "print(gc.get_freeze_count() - before >= 1000, gc.isenabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(command), "True"]
