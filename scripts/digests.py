"""Tensor digests of `reshard save` outputs over every fixture family: the check that a refactor keeps
the bytes.

    python -m scripts.digests OUT.json [--tree DIR] [--work build/digests] [--only SUBSTRING]
    python -m scripts.digests --compare A.json B.json

Builds the tiny checkpoints of tests/fixtures (every family, and the quantized variants of
tests/fixtures/quant.py) once under --work, runs `python -m reshard save` of the reshard package in
--tree (default: this checkout) for every case (TP, EP, PP, dtype and MoE-backend layouts), and
records, per case and rank file, a SHA-256 of the safetensors header without its `__metadata__` (which
holds the run id) and a SHA-256 of the data section, with the manifest's layout, serve lines and notes.
Two trees' JSON files are then compared with --compare (exit 1 on any difference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (source, save arguments): every fixture family at TP 2, the MoE ones with EP, PP where it applies
_DENSE = [
    "llama",
    "llama-tied",
    "llama-tied-lmhead",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3-fp8",
]
_MOE = ["qwen3-moe", "mixtral", "qwen2-moe", "qwen3-moe-fp8", "deepseek-v3", "deepseek-v3-fp8", "deepseek-v2-lite"]
_MOE += ["qwen3-next", "qwen3-next-fp8", "qwen3.5-moe", "gpt-oss", "llama4", "llama4-text", "glm4-moe", "minimax-m2"]
_MOE += ["minimax-m2-fp8", "kimi-k2"]
_QUANT = ["llama+fp8-tensor", "phi3+fp8-tensor-static", "llama+fp8-tensor-static", "qwen3-moe+fp8-tensor-static"]
_QUANT += ["llama+ct-channel", "llama+ct-tensor", "qwen3-moe+ct-channel", "qwen3-moe+ct-tensor"]
_QUANT += ["deepseek-v3+fp8-tensor-kv-mla", "llama+fp8-tensor-kv", "qwen3-moe+fp8-tensor-kv-alt", "llama+ct-tensor-kv"]
_QUANT += ["llama+ct-channel-kv-head", "gpt-oss+mxfp4"]

CASES: list[tuple[str, list[str]]] = (
    [(a, ["--tp", "2"]) for a in _DENSE + _MOE + _QUANT]
    + [(a, ["--tp", "4"]) for a in ["llama", "qwen3", "qwen3-moe-fp8", "phi3+fp8-tensor-static", "llama+ct-tensor"]]
    + [(a, ["--tp", "4", "--ep"]) for a in ["qwen3-moe", "qwen3-next", "glm4-moe", "deepseek-v3"]]
    + [(a, ["--tp", "2", "--ep"]) for a in [*_MOE, "qwen3-moe+ct-channel", "gpt-oss+mxfp4"]]
    + [(a, ["--tp", "1", "--pp", "2"]) for a in ["llama-tied", "gemma2", "phi3", "deepseek-v3", "qwen3-next"]]
    + [(a, ["--tp", "2", "--pp", "2"]) for a in ["qwen3-moe", "llama4", "qwen3.5-moe"]]
    + [("qwen3", ["--tp", "2", "--pp", "2", "--pp-layer-partition", "3,1"])]
    + [("qwen2", ["--tp", "2", "--dtype", "float16"]), ("llama", ["--tp", "1", "--dtype", "float32"])]
    + [("qwen3-moe-fp8", ["--tp", t, "--moe-backend", "deep_gemm"]) for t in ("2", "4")]
    + [("qwen3-moe", ["--tp", "2", "--moe-backend", "flashinfer_trtllm"])]
    + [("gpt-oss+mxfp4", ["--tp", t, "--moe-backend", b]) for t in ("2", "4") for b in ("triton", "marlin")]
    + [("qwen3", ["--tp", "2", "--max-part-size", "100KB"]), ("qwen3-moe", ["--tp", "2", "--checksum", "sha256"])]
)


def _source(work: Path, arch: str) -> Path:
    """The tiny checkpoint of `arch` ("base+scheme": quantized by tests/fixtures/quant.py), built once."""
    d = work / "src" / arch
    if (d / "config.json").is_file():
        return d
    base, _, scheme = arch.partition("+")
    code = (
        "import sys; from pathlib import Path; from tests.fixtures.tiny import make_tiny; "
        "from tests.fixtures.quant import convert; "
        f"base, scheme, d = {base!r}, {scheme!r}, Path({str(d)!r}); "
        "make_tiny(base, d.with_name(d.name + '-bf16'), shards=2) if scheme else make_tiny(base, d, shards=2); "
        "scheme and convert(d.with_name(d.name + '-bf16'), d, scheme)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return d


def file_digests(path: Path) -> dict[str, str]:
    """SHA-256 of a safetensors file's header (without __metadata__) and of its data section."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        data = hashlib.sha256()
        while chunk := f.read(1 << 22):
            data.update(chunk)
    head = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()
    return {"header": head, "data": data.hexdigest()}


def run(tree: Path, work: Path, only: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), RESHARD_DISABLE_PROGRESS="1")
    save_help = [sys.executable, "-m", "reshard", "save", "--help"]
    helptext = subprocess.run(save_help, capture_output=True, text=True, env=env, cwd=work).stdout
    # Kimi-K2's tokenizer is its own code: reshard copies it only when asked (where the flag exists)
    trust = ["--trust-remote-code"] if "--trust-remote-code" in helptext else []
    out: dict[str, dict] = {}
    for arch, args in CASES:
        case = " ".join([arch, *args])
        if only and only not in case:
            continue
        src = _source(work, arch)
        dst = work / "out" / case.replace(" ", "_").replace("/", "_")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "reshard",
                "save",
                str(src),
                str(dst),
                "--overwrite",
                *args,
                *(trust if arch.startswith("kimi") else []),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=work,
        )
        if proc.returncode != 0:
            out[case] = {"exit": proc.returncode, "error": proc.stderr.strip().splitlines()[-1:]}
        else:
            m = json.loads((dst / "reshard.json").read_text())
            files = {f["name"]: file_digests(dst / f["name"]) for f in m["files"]}
            keep = ("layout", "serve", "serve_reshard", "notes", "copied", "source_tensors", "vllm_versions")
            out[case] = {"exit": 0, "files": files, **{k: m.get(k) for k in keep}}
        print(f"{case}: exit {out[case]['exit']}", file=sys.stderr)
    return out


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            diffs.append(f"{case}: only in {'B' if case not in a else 'A'}")
            continue
        for key in sorted(set(a[case]) | set(b[case])):
            if a[case].get(key) != b[case].get(key):
                diffs.append(f"{case}: {key} differs")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--tree", type=Path, default=ROOT, help="folder holding the reshard package to run")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "digests")
    ap.add_argument("--only", help="cases whose line contains this")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        diffs = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(diffs) or f"identical: {len(json.loads(args.compare[0].read_text()))} cases")
        return 1 if diffs else 0
    if args.out is None:
        ap.error("OUT.json is required (or --compare A B)")
    result = run(args.tree.resolve(), args.work.resolve(), args.only)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    failed = [c for c, r in result.items() if r["exit"] != 0]
    print(f"{len(result)} cases, {len(failed)} refused: {failed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
