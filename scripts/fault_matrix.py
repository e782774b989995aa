"""Run the faults a user meets against the real CLI and write docs/fault-matrix.md from what happened.

    python -m scripts.fault_matrix [--out docs/fault-matrix.md] [--moments 20]

Every case is a real `python -m reshard ...` process on a checkpoint this script makes. For each it
records the exit code, the one-line message, whether the source was left byte-identical, and (for
runs over an earlier output) whether a verifying output was still there afterwards. Interrupts are
sent at many moments of a `save --overwrite`; disk full is a small tmpfs (needs root; skipped
otherwise). The chain-of-custody sections (source integrity against the project's own Hub server,
hostile folders, shared runners) are scripts/fault_cases.py, run and checked by scripts/fault_run.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import fault_cases, fault_run, fault_s3

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "PYTHONPATH": str(ROOT)}


def reshard(*args: str, timeout: float = 600) -> tuple[int, str]:
    """Exit code and what the user reads: stderr's last line (past the notes a save prints there), or
    verify's first finding."""
    verify = args[0] == "verify"
    p = subprocess.run(
        [sys.executable, "-m", "reshard", *args, *(["--json"] if verify else [])],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )
    if verify and p.stdout.strip():
        with contextlib.suppress(ValueError, KeyError, IndexError):
            found = [f for f in json.loads(p.stdout)["findings"] if f["severity"] == "error"]
            return p.returncode, (f"verify: {found[0]['message']}" if found else "")
    lines = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("note: ")]
    return p.returncode, (lines[-1] if lines else "")


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def verifies(out: Path) -> bool:
    return out.is_dir() and reshard("verify", str(out))[0] == 0


def run_id(out: Path) -> str | None:
    try:
        return json.loads((out / "reshard.json").read_text())["run_id"][:8]
    except (OSError, ValueError, KeyError):
        return None


class Matrix:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.rows: list[tuple] = []
        self.sections: list[fault_run.Section] = []
        self.atime_ok = False

    def case(self, name: str, args: list[str], *, source: Path | None, previous: Path | None = None) -> None:
        before = digest(source) if source and source.is_dir() else None
        prev = digest(previous) if previous and previous.is_dir() else None
        code, msg = reshard(*args)
        src_ok = "yes" if before is None or digest(source) == before else "**NO**"
        if previous is None:
            kept = "n/a"
        elif prev is not None and previous.is_dir() and digest(previous) == prev:
            kept = "yes, unchanged"
        else:
            kept = "yes, the new one verifies" if verifies(previous) else "**NO**"
        self.rows.append((name, code, msg.replace("|", "\\|").replace(str(self.work), "…"), src_ok, kept))
        print(f"{code:>3}  {name}: {msg[:100]}", flush=True)

    def add(self, name: str, code: int | str, msg: str, src_ok: str, kept: str) -> None:
        self.rows.append((name, code, msg.replace("|", "\\|").replace(str(self.work), "…"), src_ok, kept))
        print(f"{code!s:>3}  {name}: {msg[:100]}", flush=True)


def tiny(arch: str, dst: Path, **kw) -> Path:
    from tests.fixtures.tiny import make_tiny

    return make_tiny(arch, dst, **kw)


def edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def source_faults(m: Matrix, w: Path, llama: Path, sharded: Path) -> None:
    out = str(w / "o")
    m.case("SOURCE does not exist", ["save", str(w / "nope"), out, "--tp", "2"], source=None)
    (w / "empty").mkdir()
    m.case("SOURCE has no config.json", ["save", str(w / "empty"), out, "--tp", "2"], source=w / "empty")
    trunc = w / "trunc"
    shutil.copytree(llama, trunc)
    raw = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    m.case("a shard cut short (partial download)", ["save", str(trunc), out, "--tp", "2"], source=trunc)
    miss = w / "missing-shard"
    shutil.copytree(sharded, miss)
    next(miss.glob("model-0000*.safetensors")).unlink()
    m.case("a shard named in the index missing", ["save", str(miss), out, "--tp", "2"], source=miss)
    idx = w / "bad-index"
    shutil.copytree(sharded, idx)
    (idx / "model.safetensors.index.json").write_text('{"weight_map": 5}')
    m.case("index weight_map is not an object", ["save", str(idx), out, "--tp", "2"], source=idx)
    lst = w / "config-list"
    shutil.copytree(llama, lst)
    (lst / "config.json").write_text("[1, 2]")
    m.case("config.json is a list", ["save", str(lst), out, "--tp", "2"], source=lst)
    for name, change in [
        ('num_attention_heads is "eight"', {"num_attention_heads": "eight"}),
        ("architectures is a string", {"architectures": "LlamaForCausalLM"}),
        ("intermediate_size disagrees with the tensors", {"intermediate_size": 999}),
        ("unknown architecture", {"architectures": ["FancyNewForCausalLM"]}),
    ]:
        src = edit_config(llama, w / f"cfg-{len(m.rows)}", **change)
        m.case(name, ["save", str(src), out, "--tp", "2"], source=src)


def layout_faults(m: Matrix, w: Path, llama: Path) -> None:
    out = str(w / "o2")
    m.case("--tp that does not divide the heads", ["save", str(llama), out, "--tp", "3"], source=llama)
    m.case("--ep on a dense model", ["save", str(llama), out, "--tp", "2", "--ep"], source=llama)
    m.case(
        "--pp-layer-partition 5,-1",
        ["save", str(llama), out, "--pp", "2", "--pp-layer-partition", "5,-1"],
        source=llama,
    )


def output_faults(m: Matrix, w: Path, llama: Path) -> None:
    prev = w / "prev"
    assert reshard("save", str(llama), str(prev), "--tp", "2")[0] == 0
    m.case(
        "OUT_DIR not empty, no --overwrite", ["save", str(llama), str(prev), "--tp", "4"], source=llama, previous=prev
    )
    (w / "afile").write_text("x")
    m.case("OUT_DIR under a regular file", ["save", str(llama), str(w / "afile" / "o"), "--tp", "2"], source=llama)
    m.case("OUT_DIR in /proc", ["save", str(llama), "/proc/reshard-out", "--tp", "2"], source=llama)
    m.case("OUT_DIR inside SOURCE", ["save", str(llama), str(llama / "o"), "--tp", "2"], source=llama)
    (prev / ".reshard.json.tmp").mkdir()
    m.case(
        "stale .reshard.json.tmp folder in OUT_DIR",
        ["save", str(llama), str(prev), "--tp", "4", "--overwrite"],
        source=llama,
        previous=prev,
    )
    lock = prev.parent / f".{prev.name}.reshard.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,os,sys,time; fd=os.open(sys.argv[1], "
            "os.O_RDWR|os.O_CREAT); os.write(fd, str(os.getpid()).encode()); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print(1, flush=True); time.sleep(120)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        holder.stdout.readline()
        m.case(
            "a second save into the same OUT_DIR at once",
            ["save", str(llama), str(prev), "--tp", "2", "--overwrite"],
            source=llama,
            previous=prev,
        )
    finally:
        holder.kill()
        holder.wait()


def verify_faults(m: Matrix, w: Path, llama: Path) -> None:
    good = w / "good"
    assert reshard("save", str(llama), str(good), "--tp", "2")[0] == 0

    def damaged(name: str, fn) -> Path:
        d = w / f"v-{len(m.rows)}"
        shutil.copytree(good, d)
        fn(d)
        return d

    def flip(d: Path) -> None:
        p = d / "model-rank-1-part-0.safetensors"
        raw = bytearray(p.read_bytes())
        raw[-100] ^= 0xFF
        p.write_bytes(bytes(raw))

    cases = [
        ("verify: a flipped byte", flip),
        (
            "verify: a stray copy vLLM's glob loads",
            lambda d: shutil.copy(d / "model-rank-0-part-0.safetensors", d / "model-rank-0-part-0.old.safetensors"),
        ),
        (
            "verify: config.json edited",
            lambda d: (d / "config.json").write_text(
                (d / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
            ),
        ),
        ("verify: a rank file missing", lambda d: (d / "model-rank-1-part-0.safetensors").unlink()),
        ("verify: no manifest", lambda d: (d / "reshard.json").unlink()),
    ]
    for name, fn in cases:
        d = damaged(name, fn)
        m.case(name, ["verify", str(d)], source=None)
    m.case("verify --tp 4 on a TP 2 output", ["verify", str(good), "--tp", "4"], source=None)
    f16 = w / "f16"
    assert reshard("save", str(llama), str(f16), "--tp", "2", "--dtype", "float16")[0] == 0
    m.case("merge of a --dtype float16 output", ["merge", str(f16), str(w / "hf")], source=f16)


def interrupts(m: Matrix, w: Path, big: Path, moments: int, sig: int) -> None:
    """`save --overwrite` over a good output, interrupted at `moments` points of its run."""
    out = w / f"interrupted-{sig}"
    assert reshard("save", str(big), str(out), "--tp", "2")[0] == 0
    t0 = time.monotonic()
    assert reshard("save", str(big), str(out), "--tp", "4", "--overwrite")[0] == 0
    length = time.monotonic() - t0
    assert reshard("save", str(big), str(out), "--tp", "2", "--overwrite")[0] == 0
    src_before = digest(big)
    results = []
    for i in range(moments):
        at = length * (i + 0.5) / moments * 1.1
        old = run_id(out)
        p = subprocess.Popen(
            [sys.executable, "-m", "reshard", "save", str(big), str(out), "--tp", "4", "--overwrite"],
            env={**ENV, "PYTHONFAULTHANDLER": "1"},
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        time.sleep(at)
        p.send_signal(sig)
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # a hang is a finding: record it, with every thread's stack
            p.send_signal(signal.SIGABRT)
            _, stacks = p.communicate()
            (ROOT / "build").mkdir(exist_ok=True)
            (ROOT / "build" / f"fault-hang-{sig}-{at:.2f}.txt").write_bytes(stacks or b"")
            p.returncode = "HUNG"
        new = run_id(out)
        ok = verifies(out)
        which = "old" if new == old else "new"
        results.append((round(at, 2), p.returncode, which, ok))
        if sig == signal.SIGKILL or which == "new":  # the next run repairs what a kill left; bring back the TP 2 output
            reshard("save", str(big), str(out), "--tp", "2", "--overwrite")
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGKILL: "kill -9"}[sig]
    codes = sorted({r[1] for r in results})
    all_ok = all(r[3] for r in results)
    detail = ", ".join(f"{a}s:{c}/{w_}" for a, c, w_, _ in results)
    m.add(
        f"{name} at {moments} moments of a {length:.1f} s `save --overwrite`",
        "/".join(map(str, codes)),
        f"after each, OUT_DIR verifies: {'all' if all_ok else 'NOT ALL'} ({detail})",
        "yes" if digest(big) == src_before else "**NO**",
        "yes, every time" if all_ok else "**NO**",
    )


def disk_full(m: Matrix, w: Path, llama: Path) -> None:
    """A small tmpfs: refused up front when the new output cannot fit; ENOSPC part-way when the rank
    files fit but the copied files and manifest do not. Either way the previous output stays."""
    mnt = w / "tmpfs"
    mnt.mkdir()
    size = sum(p.stat().st_size for p in llama.rglob("*") if p.is_file())
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size * 4}", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        m.add("disk full (small tmpfs)", "-", "skipped: mounting a tmpfs needs root", "-", "-")
        return
    try:
        out = mnt / "out"
        assert reshard("save", str(llama), str(out), "--tp", "1")[0] == 0
        plan = subprocess.run(
            [sys.executable, "-m", "reshard", "plan", str(llama), "--tp", "2", "--json"],
            capture_output=True,
            text=True,
            env=ENV,
            check=True,
        )
        need = json.loads(plan.stdout)["total_bytes"]
        filler = mnt / "filler"
        for label, spare in (("not enough space for the new output", -4096), ("disk full part-way", 16384)):
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            with open(filler, "ab") as f:
                f.write(b"\0" * max(0, free - need - spare))
            m.case(
                f"{label} (tmpfs, over a previous output)",
                ["save", str(llama), str(out), "--tp", "2", "--overwrite"],
                source=llama,
                previous=out,
            )
            filler.unlink()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def write(m: Matrix, path: Path, argv: list[str]) -> None:
    lines = [
        "# Fault matrix",
        "",
        f"Written by `python -m scripts.fault_matrix{' ' + ' '.join(argv) if argv else ''}` from real runs of "
        "`python -m reshard` on checkpoints it makes (tiny Llama, 2-shard Llama, a synthetic 0.5 GB one for the "
        "interrupts). Source untouched: the source folder's bytes before and after are equal. Previous output "
        "kept: a verifying output is in OUT_DIR afterwards (the earlier one, byte-identical, unless the run "
        "completed). Exit codes are README's. In the interrupt rows, `moment:exit/output` lists each try; "
        "a signal in the first ~0.1 s lands while the Python interpreter itself starts, before any reshard code "
        "runs: Python answers it (exit 1 or -2, killed by the signal), and nothing has been touched yet.",
        "",
        "The chain-of-custody sections below (issue 24) add what each run read or wrote outside the folders it "
        "was given: a planted file (a secret, a file a symlink points at, the target of a `..` name) is hashed "
        "and stat-ed before and after, its atime first set to 0 so any read moves it "
        + (
            "(checked on this filesystem)"
            if m.atime_ok
            else "(**this filesystem does not keep atimes: reads are not seen**)"
        )
        + ", and the work folder is listed before and after for anything new or changed beyond OUT_DIR and the "
        "HF cache. Each process has a timeout (a hang is a row saying HUNG) and its wall time and peak memory.",
        "",
        "| case | exit | message (last line of stderr) | source untouched | previous output kept |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in m.rows]
    lines += fault_run.write_sections(m.sections)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "fault-matrix.md")
    ap.add_argument("--moments", type=int, default=16, help="interrupt moments per signal")
    ap.add_argument("--only", choices=["object-storage"], help="run only this section, spliced into --out")
    args = ap.parse_args(argv)
    if args.only:
        return fault_s3.only(args.out)
    with tempfile.TemporaryDirectory(prefix="reshard-faults-") as tmp:
        w = Path(tmp)
        llama = tiny("llama", w / "llama")
        sharded = tiny("llama", w / "llama-sharded", shards=3)
        big = w / "big"
        subprocess.run(
            [sys.executable, "-m", "scripts.make_synthetic", str(big), "--arch", "llama", "--size", "600MB"],
            check=True,
            env=ENV,
            cwd=ROOT,
            capture_output=True,
        )
        m = Matrix(w)
        m.atime_ok = fault_run.atime_is_kept(w)
        source_faults(m, w, llama, sharded)
        layout_faults(m, w, llama)
        output_faults(m, w, llama)
        verify_faults(m, w, llama)
        disk_full(m, w, llama)
        m.sections += [fault_cases.integrity(w, sharded), fault_cases.hostile(w, llama), fault_cases.shared(w, llama)]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            interrupts(m, w, big, args.moments, sig)
        s3_lines, s3_bad = fault_s3.section(w, llama)
        shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--out" and a != str(args.out)]
        write(m, args.out, shown)  # no path of the machine it ran on
        fault_s3.splice(args.out, s3_lines)
    bad = [r for r in m.rows if "**NO**" in (r[3], r[4]) or r[1] == 1]
    bad += [r for s in m.sections for r in s.rows if "**" in "".join(map(str, r[3:6])) or r[1] in (1, "HUNG")]
    return 1 if bad or s3_bad else 0


if __name__ == "__main__":
    sys.exit(main())
