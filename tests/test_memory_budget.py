"""The checkpoint's metadata counts inside --max-memory (issue 28): the executor's buffers get what the
process's growth since the save began leaves of it, at least a quarter; and those buffers come resident,
faulted in without holding the GIL."""

from __future__ import annotations

import ctypes
import sys

import pytest

import reshard.io.memory as memory

MIB = 1 << 20


def test_the_metadata_grown_since_the_start_is_taken_out_of_the_budget(monkeypatch):
    monkeypatch.setattr(memory, "resident_bytes", lambda: 400 * MIB)
    assert memory.metadata_budget(512 * MIB, 100 * MIB) == 212 * MIB  # 300 MiB of metadata
    assert memory.metadata_budget(512 * MIB, 380 * MIB) == 492 * MIB
    assert memory.metadata_budget(512 * MIB, 500 * MIB) == 512 * MIB  # shrunk since: nothing taken


def test_a_quarter_is_left_whatever_the_metadata(monkeypatch):
    monkeypatch.setattr(memory, "resident_bytes", lambda: 4096 * MIB)
    assert memory.metadata_budget(512 * MIB, 100 * MIB) == 128 * MIB


def test_without_a_start_the_budget_is_the_tensor_datas_alone(monkeypatch):
    monkeypatch.setattr(memory, "resident_bytes", lambda: 4096 * MIB)
    assert memory.metadata_budget(512 * MIB, None) == 512 * MIB
    assert memory.metadata_budget(512 * MIB, 0) == 512 * MIB  # resident size unknown (not Linux)


def test_resident_bytes_sees_an_allocation():
    before = memory.resident_bytes()
    block = bytearray(64 * MIB)  # zero-filled by the allocator: touched
    block[::4096] = b"x" * len(block[::4096])
    assert memory.resident_bytes() - before >= 60 * MIB
    del block


def test_a_save_with_little_memory_left_by_its_metadata_writes_the_same_bytes(tiny, tmp_path, monkeypatch):
    """The floor (a quarter of --max-memory) still moves every tensor: the same bytes as with the
    whole budget, and the executor's memory was built with the floor."""
    import reshard.execute as ex
    import tests.fixtures.saving as saving

    src = str(tiny("qwen3-moe"))
    full = saving.save(src, tmp_path / "a", tp=2)
    budgets = []
    real_options, real_memory = saving.WriteOptions, ex.Memory

    def memory_seen(budget, chunk):
        budgets.append(budget)
        return real_memory(budget, chunk)

    monkeypatch.setattr(memory, "resident_bytes", lambda: 1 << 40)  # metadata "larger than" any budget
    monkeypatch.setattr(saving, "WriteOptions", lambda *a, **k: real_options(*a, **k, rss_base=1))
    monkeypatch.setattr(ex, "Memory", memory_seen)
    low = saving.save(src, tmp_path / "b", tp=2)
    assert budgets and all(b == saving.MAX_MEMORY // 4 for b in budgets), budgets
    assert [f.name for f in full.plan.files] == [f.name for f in low.plan.files]
    for f in full.plan.files:
        a, b = (tmp_path / "a" / f.name).read_bytes(), (tmp_path / "b" / f.name).read_bytes()
        assert a[8 + int.from_bytes(a[:8], "little") :] == b[8 + int.from_bytes(b[:8], "little") :]


def test_read_buffers_are_faulted_in_by_a_foreign_call(monkeypatch):
    """The executor's read buffers come resident, faulted in by madvise(MADV_POPULATE_WRITE) through
    ctypes (`reshard.io.direct.populate`, which lets go of the GIL: MAP_POPULATE inside mmap(2) holds
    it, and the reader threads making the first buffers starved the thread handing their bytes on);
    where madvise is refused (Linux before 5.14), MAP_POPULATE as before. Both give zeroed, writable,
    page-aligned memory."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    calls = []
    real = memory.populate

    def recorded(m):
        taken = real(m)
        calls.append((len(m), taken))
        return taken

    for populate in (recorded, lambda m: False):
        monkeypatch.setattr(memory, "populate", populate)
        before = memory.resident_bytes()
        buf = memory.aligned_buffer(48 * MIB)
        assert memory.resident_bytes() - before >= 44 * MIB
        anchor = ctypes.c_char.from_buffer(buf)
        assert ctypes.addressof(anchor) % memory.ALIGN == 0
        del anchor
        assert buf[:4096] == bytes(4096) and buf[-4096:] == bytes(4096)
        buf[-5:] = b"hello"
        buf.close()
    assert calls == [(48 * MIB, True)]  # asked once, and this kernel took the advice
