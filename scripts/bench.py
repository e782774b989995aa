#!/usr/bin/env python
"""reshard's benchmark: `make bench` runs it and writes docs/benchmarks.md.

    python -m scripts.bench [--size 4GB] [--big-size 16GB] [--reps 3] [--quick] [--skip-vllm]

0. The disk's own O_DIRECT sequential read and write speeds (the physical limit: a save reads and
   writes every byte once).
1. `reshard save --tp 8` against `cp -r` + `sync` of the same checkpoint (and a naive script: for
   each rank `safetensors.torch.load_file` every shard, slice with torch as reshard's plan says,
   `save_file`), on a Llama-3-8B-shaped bf16 checkpoint, a Qwen3-30B-A3B-shaped and a
   Qwen3-235B-A22B-shaped block-FP8 MoE (scripts/make_synthetic.py) of --size, with the page
   cache dropped before each run and with the source already in it (warm). Repetitions are
   interleaved (A B A B ...); ratios are medians of per-round ratios, so a slow period hurts both
   sides of a ratio alike. CPU seconds (user + sys of the child, from its rusage) per GB written.
   Every timed run holds --lock (flock), so that timed runs of several benchmarks never overlap.
2. Peak RSS of `reshard save` on a --small-size and a --big-size checkpoint (the big one larger
   than half of this machine's memory when the disk allows), next to the largest tensor.
3. One rank's load: time and bytes read (/proc/self/io read_bytes, after dropping the cache) to
   get its tensors from the reshard output, against reading and narrowing them from the original
   checkpoint as vLLM's default loader does (every rank reads every shard).
4. With .venv-vllm (a vLLM build): vLLM's own "Loading weights took" for load_format
   "sharded_state" against the default loader, at T=2.

`python -m scripts.bench loaders` (scripts/bench_loaders.py) measures vLLM's load time for
`--load-format reshard` (reshard's plugin) against sharded_state and the default loader, cold and
warm page cache.

Everything is written under --work (default build/bench, git-ignored) and removed at the end
unless --keep. Internal sub-commands (_naive, _load, _vllm) run the measured pieces in their own
processes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import json
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.make_synthetic import make_config, parse_size, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]

GB = 1e9
GIB = 2**30
TIME = Path("/usr/bin/time")


# ---- measuring -----------------------------------------------------------------------------


class Cache:
    """Drops the page cache before a run when we may (root on Linux); says which."""

    def __init__(self) -> None:
        self.enabled = self._try()

    @staticmethod
    def _try() -> bool:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

    def prepare(self, state: str, src: Path) -> None:
        """state "dropped": nothing of `src` in the page cache (if we may); "warm": all of it."""
        if state == "warm":
            os.sync()
            subprocess.run(["cat", *map(str, sorted(src.glob("*.safetensors")))], stdout=subprocess.DEVNULL)
        else:
            self.drop([src])

    def drop(self, warm: list[Path] | None = None) -> None:
        if self.enabled:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        elif warm:  # cache-fair instead: every run starts with the source in the page cache
            for p in warm:
                subprocess.run(["cat", *map(str, sorted(p.glob("*.safetensors")))], stdout=subprocess.DEVNULL)

    def describe(self) -> str:
        if self.enabled:
            return (
                "dropped before every timed run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root), or for the "
                "*warm* tables filled with the source (`cat` of its shards) instead"
            )
        return (
            "could not be dropped (not root): every run starts with the source read once into the page "
            "cache (hot, cache-fair); the checkpoints fit in RAM, so cold-cache numbers are not measured"
        )


LOCK = Path("/tmp/bench.lock")


@contextlib.contextmanager
def timed_alone():
    """Hold LOCK (flock) while a run is prepared and timed: timed runs of benchmarks sharing the
    machine (ours and others' using the same lock) never overlap."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_measured(
    cmd: list[str], *, log: Path, env: dict | None = None, timeout: float = 3600, sync: bool = True
) -> dict:
    """Run cmd (then `sync`, so buffered writes count): wall seconds, CPU seconds, peak RSS."""
    rss_file = log.with_suffix(".rss")
    rss_file.unlink(missing_ok=True)
    # the child's own peak: wait4's ru_maxrss would include this process's image, copied by fork
    timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd] if TIME.exists() else cmd
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        t0 = time.perf_counter()
        p = subprocess.Popen(timed, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # this tree's reshard
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        t1 = time.perf_counter()
        if sync:
            os.sync()
        t2 = time.perf_counter()
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[:4]} failed (rc={p.returncode}):\n{tail}")
    rss = ru.ru_maxrss
    if rss_file.exists():
        with contextlib.suppress(ValueError, IndexError):
            rss = int(rss_file.read_text().split()[-1])
        rss_file.unlink()
    return {
        "seconds": t2 - t0,
        "sync_seconds": t2 - t1,
        "cpu": ru.ru_utime + ru.ru_stime,
        "rss": rss * 1024,
        "load": os.getloadavg()[0],
    }


def disk_speeds(files: list[Path], scratch: Path, nbytes: int = 2 * 10**9, block: int = 16 * 2**20) -> dict:
    """The disk's own sequential speeds, page cache bypassed (O_DIRECT): read `files` (dropped
    cache), write `nbytes` to `scratch` and fsync. GB/s; None where O_DIRECT is refused."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    out: dict = {"read": None, "write": None}
    try:
        total, t0 = 0, time.perf_counter()
        for p in files:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                while n := os.readv(fd, [buf]):
                    total += n
            finally:
                os.close(fd)
        out["read"] = total / (time.perf_counter() - t0) / GB
    except OSError:
        pass
    try:
        buf.write(os.urandom(block))
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            t0 = time.perf_counter()
            for _ in range(nbytes // block):
                os.write(fd, buf)
            os.fsync(fd)
            out["write"] = nbytes // block * block / (time.perf_counter() - t0) / GB
        finally:
            os.close(fd)
            scratch.unlink()
    except OSError:
        pass
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt_s(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_b(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def plan_times(tp: int = 8, reps: int = 3) -> list[dict]:
    """`build_plan` from headers alone (tests/fixtures/synthetic.py: the real models' names and shapes, no
    bytes): best wall and CPU seconds of `reps`, for the largest dense and MoE configs we target."""
    from reshard.plan import build_plan
    from tests.fixtures.synthetic import LLAMA_3_70B, QWEN3_235B_A22B_FP8, synthetic_checkpoint

    out = []
    for name, config, files in (("Llama-3-70B", LLAMA_3_70B, 30), ("Qwen3-235B-A22B-FP8", QWEN3_235B_A22B_FP8, 48)):
        ckpt = synthetic_checkpoint(config, files=files)
        wall, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = build_plan(ckpt, tp=tp)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        tensors = sum(len(f.tensors) for f in plan.files)
        out.append({"model": name, "tp": tp, "tensors": tensors, "seconds": min(wall), "cpu": min(cpu)})
    return out


# ---- sub-commands run in their own processes ---------------------------------------------------


def cmd_naive(src: Path, out: Path, tp: int) -> None:
    """The obvious script: per rank, load every shard whole, slice with torch, save_file."""
    from safetensors.torch import load_file, save_file

    from reshard.plan import build_plan
    from reshard.sources import open_source
    from tests.fixtures.reference import materialize  # the plan read with torch, whole tensors

    ckpt = open_source(str(src)).checkpoint
    plan = build_plan(ckpt, tp=tp)
    out.mkdir(parents=True, exist_ok=True)
    for _, files in sorted(plan.ranks().items()):
        source = {}
        for shard in ckpt.files:
            source.update(load_file(src / shard))
        for f in files:
            save_file({t.name: materialize(t, source) for t in f.tensors}, out / f.name, metadata={"format": "pt"})
        del source


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def cmd_load(mode: str, path: Path, tp: int, rank: int, src: Path | None) -> None:
    """One rank's tensors: from reshard's rank files, or narrowed out of the original checkpoint."""
    import torch  # noqa: F401 - imported before counting: its libraries are reads too
    from safetensors import safe_open

    slices: dict[str, list[tuple]] = {}
    if mode != "sharded":
        from reshard.plan import Slice, build_plan
        from reshard.sources import open_source

        ckpt = open_source(str(path)).checkpoint
        plan = build_plan(ckpt, tp=tp)
        for f in plan.files:
            if f.tp_rank == rank:
                for t in f.tensors:
                    for p in t.pieces:
                        if isinstance(p, Slice):
                            slices.setdefault(p.source, []).append(
                                tuple(slice(a, b) for a, b in zip(p.start, p.stop, strict=True))
                            )
    r0, t0, tensor_bytes = _read_bytes(), time.perf_counter(), 0
    if mode == "sharded":
        for f in sorted(path.glob(f"model-rank-{rank}-part-*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():  # noqa: SIM118
                    tensor_bytes += h.get_tensor(k).clone().nbytes  # mmap-backed: clone reads it
    else:
        for shard in ckpt.files:  # every rank iterates every shard, as vLLM's default loader
            with safe_open(str(path / shard), "pt") as h:
                for k in h.keys():  # noqa: SIM118
                    if mode == "default":  # safetensors_weights_iterator: get_tensor, then narrow
                        whole = h.get_tensor(k)
                        for idx in slices.get(k, []):
                            tensor_bytes += whole[idx].clone().nbytes
                    else:  # get_slice: read only the rows asked for
                        for idx in slices.get(k, []):
                            tensor_bytes += h.get_slice(k)[idx].clone().nbytes
    print(
        json.dumps(
            {"seconds": time.perf_counter() - t0, "read_bytes": _read_bytes() - r0, "tensor_bytes": tensor_bytes}
        )
    )


VLLM_SCRIPT = r"""
import sys, time
if __name__ == "__main__":
    from vllm import LLM
    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], load_format=sys.argv[2], tensor_parallel_size=int(sys.argv[3]), enforce_eager=True,
              max_model_len=256, max_num_seqs=1, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              distributed_executor_backend="mp")
    print(f"BENCH_ENGINE_READY {time.perf_counter() - t0:.3f}", flush=True)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
"""


# ---- the benchmark ------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = a.work.resolve()
        self.log = self.work / "bench.log"
        self.cache = Cache()
        self.results: dict = {"started": _dt.datetime.now().isoformat(timespec="seconds")}
        self.notes: list[str] = []
        self.py = sys.executable

    def say(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def make(self, name: str, arch: str, size: int, *, fp8: bool = False) -> dict:
        out = self.work / name
        if out.exists():
            shutil.rmtree(out)
        self.say(f"generating {name}: {arch}{' fp8' if fp8 else ''} {size / GB:.1f} GB")
        info = write_checkpoint(out, make_config(arch, size, fp8=fp8))
        info["arch"] = arch + (" fp8" if fp8 else "")
        return info

    def free(self) -> int:
        return shutil.disk_usage(self.work).free

    def save_cmd(self, src: Path, out: Path, tp: int) -> list[str]:
        return [self.py, "-m", "reshard", "save", str(src), str(out), "--tp", str(tp)]

    # -- 1 --
    def compare(self, ck: dict, tp: int, state: str) -> dict:
        src = Path(ck["path"])
        out = self.work / "out"
        cmds = {
            "reshard save": self.save_cmd(src, out, tp),
            "cp -r": ["cp", "-r", str(src), str(out)],
        }
        if self.a.naive and ck["bytes"] * 2.5 < _mem_total():
            cmds["naive script"] = [self.py, "-m", "scripts.bench", "_naive", str(src), str(out), "--tp", str(tp)]
        elif self.a.naive:
            self.notes.append(f"naive script skipped on {ck['arch']}: it holds the whole checkpoint in memory per rank")
        runs: dict[str, list[dict]] = {k: [] for k in cmds}
        for rep in range(self.a.reps):
            for name, cmd in cmds.items():
                shutil.rmtree(out, ignore_errors=True)
                with timed_alone():
                    self.cache.prepare(state, src)
                    r = run_measured(cmd, log=self.log)
                runs[name].append(r)
                self.say(f"  {ck['arch']} {state} round {rep + 1}: {name} {r['seconds']:.2f} s, CPU {r['cpu']:.2f} s "
                         f"(load {r['load']:.1f})")  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        base = runs["reshard save"]
        rows = {}
        for name, rs in runs.items():
            secs = [r["seconds"] for r in rs]
            rows[name] = {
                "seconds": secs,
                "median": med(secs),
                "cpu": med([r["cpu"] for r in rs]),
                "cpu_per_gb": med([r["cpu"] for r in rs]) / (ck["bytes"] / GB),  # every byte is written once
                "rss": max(r["rss"] for r in rs),
                "gbps": ck["bytes"] / med(secs) / GB,
                # per round, reshard's time over this one's: < 1 means reshard is faster
                "reshard_over": med([b["seconds"] / r["seconds"] for b, r in zip(base, rs, strict=True)]),
            }
        return {"checkpoint": ck, "tp": tp, "state": state, "rows": rows,
                "commands": {k: self.shown(v) for k, v in cmds.items()}}  # fmt: skip

    def shown(self, cmd: list[str]) -> str:
        """A command as the doc shows it: paths relative to the repository, `python` for this one."""
        out = []
        for x in cmd:
            if x == self.py:
                x = "python"
            elif x.startswith(str(ROOT) + os.sep):
                x = os.path.relpath(x, ROOT)
            out.append(x)
        return " ".join(out)

    # -- 2 --
    def rss(self, ck: dict, tp: int) -> dict:
        src, out = Path(ck["path"]), self.work / "out"
        shutil.rmtree(out, ignore_errors=True)
        with timed_alone():
            self.cache.drop([src])
            r = run_measured(self.save_cmd(src, out, tp), log=self.log)
        shutil.rmtree(out, ignore_errors=True)
        self.say(f"  rss {ck['bytes'] / GB:.1f} GB: {fmt_b(r['rss'])} in {r['seconds']:.1f} s")
        return {"checkpoint": ck, "tp": tp, **r}

    # -- 3 --
    def per_rank(self, ck: dict, tp: int) -> dict:
        src, out = Path(ck["path"]), self.work / "out-rank"
        shutil.rmtree(out, ignore_errors=True)
        run_measured(self.save_cmd(src, out, tp), log=self.log)
        from reshard.plan import Slice, build_plan
        from reshard.sources import open_source

        ckpt = open_source(str(src)).checkpoint
        plan = build_plan(ckpt, tp=tp)
        mine = [t for f in plan.files if f.tp_rank == 0 for t in f.tensors]
        need = sum(t.nbytes for t in mine)

        def whole(p: Slice) -> bool:  # a piece that is its whole source tensor: replicated on every rank
            return not p.up and not any(p.start) and tuple(p.stop) == tuple(ckpt.tensors[p.source].shape)

        replicated = sum(
            t.nbytes for t in mine if any(isinstance(p, Slice) for p in t.pieces)
            and all(whole(p) for p in t.pieces if isinstance(p, Slice))
        )  # fmt: skip
        modes = {
            "reshard rank files (safe_open + get_tensor)": ["sharded", str(out)],
            "original, vLLM default loader (get_tensor + narrow)": ["default", str(src)],
            "original, safe_open + get_slice": ["slice", str(src)],
        }
        runs: dict[str, list[dict]] = {k: [] for k in modes}
        for _ in range(max(2, self.a.reps - 1)):
            for name, args in modes.items():
                self.cache.drop([src, out])
                p = subprocess.run(
                    [self.py, "-m", "scripts.bench", "_load", *args, "--tp", str(tp), "--rank", "0"],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )  # fmt: skip
                runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
        shutil.rmtree(out, ignore_errors=True)
        rows = {
            name: {
                "seconds": [r["seconds"] for r in rs],
                "median": med([r["seconds"] for r in rs]),
                "read_bytes": med([r["read_bytes"] for r in rs]),
                "tensor_bytes": rs[0]["tensor_bytes"],
            }
            for name, rs in runs.items()
        }
        self.say("  per-rank: " + ", ".join(f"{k.split(' (')[0]} {v['median']:.2f} s" for k, v in rows.items()))
        return {"checkpoint": ck, "tp": tp, "rank_bytes": need, "replicated_bytes": replicated, "rows": rows}

    # -- 4 --
    def vllm(self, ck: dict, tp: int) -> dict | None:
        vpy = ROOT / ".venv-vllm" / "bin" / "python"
        if not vpy.exists():
            self.notes.append("vLLM comparison skipped: no .venv-vllm (see shared/README.md or `make test-vllm`)")
            return None
        src, out = Path(ck["path"]), self.work / f"out-vllm-tp{tp}"
        shutil.rmtree(out, ignore_errors=True)
        run_measured(self.save_cmd(src, out, tp), log=self.log)
        script = self.work / "vllm_load.py"
        script.write_text(VLLM_SCRIPT)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        loaders = {"default (HF safetensors)": ("auto", src), "sharded_state (reshard output)": ("sharded_state", out)}
        runs: dict[str, list[dict]] = {k: [] for k in loaders}
        for _ in range(self.a.vllm_reps):
            for name, (fmt, path) in loaders.items():
                self.cache.drop([path])
                log = self.work / f"vllm-{fmt}.log"
                log.write_text("")
                try:
                    r = run_measured([str(vpy), str(script), str(path), fmt, str(tp)], log=log, env=env,
                                     timeout=self.a.vllm_timeout, sync=False)  # fmt: skip
                except RuntimeError as e:
                    self.notes.append(f"vLLM {fmt} failed: {str(e).splitlines()[0]} (log kept: {log})")
                    self.a.keep = True
                    return None
                text = log.read_text(errors="replace")
                took = [float(x) for x in re.findall(r"Loading weights took ([0-9.]+) seconds", text)]
                ready = re.findall(r"BENCH_ENGINE_READY ([0-9.]+)", text)
                r.update(weights=max(took) if took else float("nan"), ready=float(ready[-1]) if ready else float("nan"))
                runs[name].append(r)
                self.say(f"  vllm {fmt}: weights {r['weights']:.2f} s, engine {r['ready']:.1f} s")
        shutil.rmtree(out, ignore_errors=True)
        return {
            "checkpoint": ck,
            "tp": tp,
            "rows": {
                n: {"weights": [r["weights"] for r in rs], "weights_med": med([r["weights"] for r in rs]),
                    "ready_med": med([r["ready"] for r in rs]), "rss": max(r["rss"] for r in rs)}
                for n, rs in runs.items()
            },
        }  # fmt: skip

    # -- all --
    def run(self) -> None:
        a = self.a
        self.work.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        t_start = time.perf_counter()
        self.results["machine"] = machine(self.work)
        self.results["load_start"] = os.getloadavg()
        self.say(f"page cache: {'dropped before each run' if self.cache.enabled else 'NOT dropped (not root)'}")
        try:
            main = self.make("llama", "llama", a.size)
            self.say("0. the disk's O_DIRECT speeds")
            with timed_alone():
                self.cache.drop([Path(main["path"])])
                self.results["disk"] = disk_speeds(sorted(Path(main["path"]).glob("*.safetensors")),
                                                   self.work / "disk-scratch")  # fmt: skip
            self.say(f"1. save --tp {a.tp} vs cp -r vs naive")
            self.results["compare"] = [self.compare(main, a.tp, s) for s in ("dropped", "warm")]
            if a.moe:
                for name, arch in (("qwen3-moe-fp8", "qwen3-moe"), ("qwen3-235b-fp8", "qwen3-235b")):
                    moe = self.make(name, arch, a.size, fp8=True)
                    self.results["compare"] += [self.compare(moe, a.tp, s) for s in ("dropped", "warm")]
                    shutil.rmtree(moe["path"])
            self.say("3. per-rank load")
            self.results["per_rank"] = self.per_rank(main, a.tp)
            if a.vllm:
                self.say("4. vLLM load time")
                self.results["vllm"] = self.vllm(main, 2)
            self.say("5. planning time")
            self.results["plan"] = plan_times()
            self.say("2. peak RSS")
            small = self.make("llama-small", "llama", a.small_size)
            rss = [self.rss(small, a.tp)]
            shutil.rmtree(small["path"])
            rss.append(self.rss(main, a.tp))
            shutil.rmtree(main["path"])
            big_size = a.big_size
            room = self.free() - 2 * GB
            if big_size * 2.05 > room:
                fit = int(room / 2.05)
                self.notes.append(
                    f"--big-size {big_size / GB:.0f} GB and its output do not fit the free disk "
                    f"({self.free() / GB:.0f} GB): used {fit / GB:.1f} GB"
                )
                big_size = fit
            if big_size > a.size:
                big = self.make("llama-big", "llama", big_size)
                rss.append(self.rss(big, a.tp))
                shutil.rmtree(big["path"])
            self.results["rss"] = rss
        finally:
            self.results["load_end"] = os.getloadavg()
            self.results["minutes"] = (time.perf_counter() - t_start) / 60
            self.results.update(notes=self.notes, cache=self.cache.describe(), argv=a.argv, reps=a.reps)
            (self.work / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
            if not a.keep:
                for p in self.work.iterdir():
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
        from scripts.bench_loaders import section_of

        text = keep_hub_section(a.out, report(self.results))  # `bench hub`'s section survives a full run
        kept = section_of(a.out)  # and so does `bench loaders`'
        a.out.write_text(text if not kept or kept in text else f"{text.rstrip()}\n\n{kept}")
        self.say(f"wrote {a.out} in {self.results['minutes']:.1f} min")


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024


def machine(work: Path) -> dict:
    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    du = shutil.disk_usage(work)
    fstype = (sh("df", "--output=fstype", str(work)).splitlines()[-1:] or [""])[0].strip()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    from importlib.metadata import version  # no import: this process stays small (see run_measured)

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram": _mem_total(),
        "disk": f"{fstype}, {du.total / GB:.0f} GB, {du.free / GB:.0f} GB free",
        "uname": sh("uname", "-srvmo") or " ".join(platform.uname()),
        "python": platform.python_version(),
        "versions": f"torch {version('torch')}, safetensors {version('safetensors')}, numpy {version('numpy')}, "
        f"blake3 {version('blake3')}",
        "commit": sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD")
        + (" (+ uncommitted changes)" if sh("git", "-C", str(ROOT), "status", "--porcelain", "reshard") else ""),
    }


def report(r: dict) -> str:
    m, notes, argv = r["machine"], r.get("notes", []), r.get("argv", [])
    L = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (`python -m scripts.bench{' ' + ' '.join(argv) if argv else ''}`) on "
        f"{r['started']}, in {r['minutes']:.0f} min. Checkpoints are synthetic (`python -m scripts.make_synthetic`): the real "
        "architectures' tensor names, shapes and dtypes with fewer layers, sharded like a Hub download.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPUs | {m['nproc']} × {m['cpu']} |",
        f"| RAM | {m['ram'] / GIB:.1f} GiB |",
        f"| disk | {m['disk']} |",
        f"| uname | {m['uname']} |",
        f"| software | Python {m['python']}, {m['versions']}, reshard {m['commit']} |",
        f"| page cache | {r.get('cache', '')} |",
        f"| load average | {r['load_start'][0]:.1f} at the start, {r['load_end'][0]:.1f} at the end "
        "(1-minute; other jobs share this machine, so single runs are noisy: read the medians and ratios) |",
        "",
    ]
    d = r.get("disk")
    if d:
        speed = {k: f"{v:.2f} GB/s" if v else "O_DIRECT refused" for k, v in d.items()}
        L += [
            "## 0. The disk",
            "",
            f"Its own sequential speeds with the page cache bypassed (O_DIRECT, 16 MiB requests): reading the llama "
            f"checkpoint {speed['read']}, writing 2 GB and fsync {speed['write']}. A save reads and writes every byte "
            "once on this one disk, so its floor is about size / read + size / write when reads and writes take "
            "turns, size / max(read, write) when the device overlaps them.",
            "",
        ]
    for i, c in enumerate(r.get("compare", [])):
        ck, state = c["checkpoint"], c.get("state", "dropped")
        if i == 0:
            L += [
                f"## 1. `reshard save --tp {c['tp']}` vs `cp -r`",
                "",
                f"{r.get('reps', len(c['rows']['reshard save']['seconds']))} interleaved rounds per table; every timed "
                "command is followed by `sync` (reshard fsyncs its files itself), so buffered writes count. *dropped*: "
                "page cache dropped before each run; *warm*: the source read into it first. *CPU s/GB*: the child's "
                "user + sys seconds (rusage) per GB written. *reshard / this*: median over rounds of reshard's time "
                "divided by this command's time in the same round (< 1: reshard is faster). Default checksum "
                "(BLAKE3) on.",
                "",
            ]
        disk = ""
        if d and d.get("read") and d.get("write"):
            floor = ck["bytes"] / GB / d["read"] + ck["bytes"] / GB / d["write"]
            disk = f" Disk floor (read + write, O_DIRECT): {floor:.2f} s."
        L += [
            f"**{ck['arch']}, {state}**: {ck['bytes'] / GB:.2f} GB, {ck['layers']} layers, {ck['tensors']} tensors "
            f"in {ck['shards']} shards; largest tensor {ck['largest_tensor']} ({ck['largest_tensor_bytes'] / GB:.2f} "
            f"GB).{disk if state == 'dropped' else ''}",
            "",
            "| command | median s | runs s | GB/s | CPU s (user+sys) | CPU s/GB | peak RSS | reshard / this |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for name, row in c["rows"].items():
            per_gb = row.get("cpu_per_gb", row["cpu"] / (ck["bytes"] / GB))
            L.append(
                f"| {name} | {fmt_s(row['median'])} | {' '.join(fmt_s(x) for x in row['seconds'])} | "
                f"{row['gbps']:.2f} | {row['cpu']:.1f} | {per_gb:.2f} | {fmt_b(row['rss'])} | "
                f"{row['reshard_over']:.2f} |"
            )
        L.append("")
    if r.get("rss"):
        L += [
            f"## 2. Peak RSS of `reshard save --tp {r['rss'][0]['tp']}`",
            "",
            f"Peak resident memory of the process (`/usr/bin/time` %M); the machine has {m['ram'] / GIB:.1f} GiB. "
            "The buffers are bounded by the executor's max_memory (default 512 MiB), not by tensor or file sizes.",
            "",
            "| checkpoint | size | largest tensor | time s | GB/s | peak RSS |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for x in r["rss"]:
            ck = x["checkpoint"]
            L.append(
                f"| {ck['arch']}, {ck['layers']} layers | {ck['bytes'] / GB:.2f} GB | "
                f"{ck['largest_tensor_bytes'] / GB:.2f} GB ({ck['largest_tensor']}) | {fmt_s(x['seconds'])} | "
                f"{ck['bytes'] / x['seconds'] / GB:.2f} | {fmt_b(x['rss'])} |"
            )
        L.append("")
    pr = r.get("per_rank")
    if pr:
        ck = pr["checkpoint"]
        L += [
            f"## 3. One rank's load (rank 0 of {pr['tp']})",
            "",
            f"Rank 0 needs {pr['rank_bytes'] / GB:.3f} GB of tensors (1/{pr['tp']} of {ck['bytes'] / GB:.2f} GB is "
            f"{ck['bytes'] / pr['tp'] / GB:.3f} GB; replicated whole tensors: {pr['replicated_bytes'] / 2**20:.2f} MiB). "
            "Bytes read: `read_bytes` of /proc/self/io, from a dropped page cache (kernel read-ahead included). "
            "Each variant runs in its own process; medians of interleaved runs. safetensors maps the file, so "
            "narrowing a `get_tensor` result reads only the pages it touches: a row split reads about 1/T of a "
            "tensor, a column split (o_proj, down_proj) all of it; hence well under the whole checkpoint, "
            "but several times what one rank needs.",
            "",
            "| how | median s | runs s | bytes read | of the checkpoint |",
            "|---|---:|---|---:|---:|",
        ]
        for name, row in pr["rows"].items():
            L.append(
                f"| {name} | {fmt_s(row['median'])} | {' '.join(fmt_s(x) for x in row['seconds'])} | "
                f"{row['read_bytes'] / GB:.3f} GB | {row['read_bytes'] / ck['bytes']:.3f} |"
            )
        L.append("")
    v = r.get("vllm")
    if v:
        ck = v["checkpoint"]
        L += [
            f"## 4. vLLM (CPU build) weight loading at T={v['tp']}",
            "",
            f"{ck['arch']}, {ck['layers']} layers, {ck['bytes'] / GB:.2f} GB; `LLM(..., tensor_parallel_size={v['tp']}, "
            "enforce_eager=True, max_model_len=256, skip_tokenizer_init=True)` with VLLM_CPU_KVCACHE_SPACE=1 "
            "VLLM_CPU_OMP_THREADS_BIND=nobind, page cache dropped before each engine. *weights*: the largest "
            '"Loading weights took X seconds" its workers log; *engine*: LLM() construction, start to ready.',
            "",
            "| loader | weights s (median) | runs s | engine s (median) |",
            "|---|---:|---|---:|",
        ]
        for name, row in v["rows"].items():
            L.append(
                f"| {name} | {fmt_s(row['weights_med'])} | {' '.join(fmt_s(x) for x in row['weights'])} | "
                f"{fmt_s(row['ready_med'])} |"
            )
        L.append("")
    if r.get("plan"):
        L += [
            "## 5. Planning time",
            "",
            "`build_plan` at TP 8 from the headers alone (tests/fixtures/synthetic.py: the real models' tensor names, "
            "shapes and dtypes, every layer; no byte read), best of 3 in this process.",
            "",
            "| model | output tensors | wall s | CPU s |",
            "|---|---:|---:|---:|",
            *[f"| {x['model']} | {x['tensors']} | {x['seconds']:.2f} | {x['cpu']:.2f} |" for x in r["plan"]],
            "",
        ]
    L += targets(r)
    L += [
        "## How `reshard save` gets there",
        "",
        "- Reader threads read source row chunks (32 MiB) ahead, in the order the plan will use them, into reused "
        "buffers; four reads in flight also keep the disk busy through an MoE's thousands of small tensors. A "
        "source file in the page cache is copied out of it; one that is not (16 pages sampled) is read with "
        "O_DIRECT, which spares the kernel's allocation and copy of every page (*dropped* vs *warm* CPU s/GB).",
        "- The main thread hands every rank views of the rows it needs: no copies, no whole tensors.",
        "- Per output file, a writer thread hashes (BLAKE3, about twice sha256's speed per core) and an I/O thread "
        "writes with O_DIRECT: no page-cache copy and no dirty-page throttling. Contiguous pieces (row splits, "
        "whole experts, replicated tensors) of 1 MiB and more go to disk straight from the read buffer: the "
        "headers are padded so that most of a file's tensors start on a page, as they lie in the buffers. Smaller "
        "ones from 64 KiB (an MoE's experts at TP 8) that line up with their file are held, not copied, and "
        "written with the stage in one vectored write. Column splits, small pieces and pieces off a page boundary "
        "(O_DIRECT reads keep a tensor's page offset in the source) are gathered into 4 MiB aligned stages (the "
        "one copy they need).",
        "- Memory: the executor's max_memory (default 512 MiB) of reused buffers plus 8 MiB per open output file, "
        "whatever the checkpoint or tensor size.",
        "- What bounds it: the disk, which serves the reads and the writes (every byte is read once and written "
        "once). Its CPU per GB: the hash, the kernel's copy of each source byte out of the page cache (warm) or "
        "the gathering of pieces that O_DIRECT reads leave off a page boundary (dropped), the kernel's I/O, and "
        "Python's per-piece work, which MoE checkpoints' thousands of small tensors multiply.",
        "",
    ]
    if notes:
        L += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    L += [
        "## Commands",
        "",
        "```",
        *sorted({cmd for c in r.get("compare", []) for cmd in c["commands"].values()}),
        "```",
        "",
        "`_naive` is scripts/bench.py's naive script: for each rank, `safetensors.torch.load_file` every shard, "
        "slice with torch as reshard's plan says, `save_file`. Raw numbers: build/bench/results.json. Re-run "
        "with `make bench` (the full benchmark) or `python -m scripts.bench --report-only` (rewrite this file "
        "from build/bench/results.json).",
        "",
    ]
    return "\n".join(L)


def targets(r: dict) -> list[str]:
    out = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for c in r.get("compare", []):
        rows, ck, state = c["rows"], c["checkpoint"], c.get("state", "dropped")
        cp = rows["cp -r"]["reshard_over"]
        limit = 0.9 if state == "dropped" else 1.0
        out.append(
            f"| save --tp {c['tp']} / (cp -r + sync) <= {limit} ({ck['arch']}, {ck['bytes'] / GB:.1f} GB, {state}) | "
            f"{cp:.2f} | {'yes' if cp <= limit else 'no'} |"
        )
        per_gb = rows["reshard save"].get("cpu_per_gb", rows["reshard save"]["cpu"] / (ck["bytes"] / GB))
        out.append(
            f"| CPU s per GB written <= 0.8 ({ck['arch']}, {state}) | {per_gb:.2f} | {'yes' if per_gb <= 0.8 else 'no'} |"
        )
        if "naive script" in rows:
            x = 1 / rows["naive script"]["reshard_over"]
            out.append(
                f"| >= 3x faster than the naive script ({ck['arch']}) | {x:.1f}x | {'yes' if x >= 3 else 'no'} |"
            )
    rss = r.get("rss") or []
    if len(rss) >= 2:
        lo, hi = min(x["rss"] for x in rss), max(x["rss"] for x in rss)
        sizes = " / ".join(f"{x['checkpoint']['bytes'] / GB:.0f} GB: {fmt_b(x['rss'])}" for x in rss)
        ok = hi <= 1.5 * GIB and hi <= 1.25 * lo + 64 * 2**20
        out.append(f"| peak RSS flat (and <= 1.5 GiB) | {sizes} | {'yes' if ok else 'no'} |")
    pr = r.get("per_rank")
    if pr:
        row = pr["rows"]["reshard rank files (safe_open + get_tensor)"]
        want = pr["checkpoint"]["bytes"] / pr["tp"] + pr["replicated_bytes"]
        ok = row["read_bytes"] <= want * 1.05 + 16 * 2**20
        out.append(
            f"| one rank reads 1/T + replicated ({want / GB:.3f} GB) | {row['read_bytes'] / GB:.3f} GB | "
            f"{'yes' if ok else 'no'} |"
        )
    return [*out, ""]


_PY = re.compile(r"(?<![\w.])/\S*/bin/python[\d.]*")
_IN_TREE = re.compile(r"(?<![\w.])/\S*?/(build|docs|tests|scripts|reshard)/")
_ABS = re.compile(r"(?<![\w.])/(?:tmp|work|home|root)/\S*/")


def scrub(text: str) -> str:
    """`text` without the absolute paths of the machine it ran on: interpreters become `python`,
    paths inside a checkout relative to it, other folders dropped down to the file's name."""
    return _ABS.sub("", _IN_TREE.sub(r"\1/", _PY.sub("python", text)))


def keep_hub_section(path: Path, text: str) -> str:
    """`text` with the hub section (`python -m scripts.bench hub`) that `path` holds kept at its end."""
    from scripts.bench_hub import MARK

    old = path.read_text() if path.exists() else ""
    return text.rstrip("\n") + "\n\n" + old[old.index(MARK) :] if MARK in old else text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "hub":  # reshard save from a local Hub server (scripts/bench_hub.py)
        from scripts.bench_hub import main as hub_main

        return hub_main(argv[1:])
    if argv and argv[0] == "loaders":  # vLLM load time by loader, reshard's plugin included
        from scripts import bench_loaders

        return bench_loaders.main(argv[1:])
    if argv and argv[0] == "_naive":
        p = argparse.ArgumentParser()
        p.add_argument("src", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--tp", type=int, default=8)
        x = p.parse_args(argv[1:])
        cmd_naive(x.src, x.out, x.tp)
        return 0
    if argv and argv[0] == "_load":
        p = argparse.ArgumentParser()
        p.add_argument("mode", choices=["sharded", "default", "slice"])
        p.add_argument("path", type=Path)
        p.add_argument("--tp", type=int, default=8)
        p.add_argument("--rank", type=int, default=0)
        x = p.parse_args(argv[1:])
        cmd_load(x.mode, x.path, x.tp, x.rank, None)
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size", type=parse_size, default=parse_size("4GB"), help="checkpoint size for 1 and 3 (default 4GB)"
    )
    ap.add_argument("--small-size", type=parse_size, default=parse_size("2GB"), help="small checkpoint for 2 and 4")
    ap.add_argument(
        "--big-size", type=parse_size, default=parse_size("16GB"), help="big checkpoint for 2 (default 16GB)"
    )
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--vllm-reps", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 GB checkpoints, 2 rounds, no MoE, no vLLM")
    ap.add_argument("--skip-vllm", dest="vllm", action="store_false")
    ap.add_argument("--skip-moe", dest="moe", action="store_false")
    ap.add_argument("--skip-naive", dest="naive", action="store_false")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and logs under --work")
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --work/results.json, run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        a.out.write_text(keep_hub_section(a.out, report(json.loads((a.work / "results.json").read_text()))))
        return 0
    a.argv = argv
    if a.quick:
        a.size, a.small_size, a.big_size = parse_size("1GB"), parse_size("1GB"), parse_size("2GB")
        a.reps, a.vllm, a.moe = min(a.reps, 2), False, False
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Bench(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
