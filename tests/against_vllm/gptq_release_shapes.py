"""Record what vLLM 0.32 builds for the header-only GPTQ release of tests/fixtures/gptq_releases (issue 26).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=$PWD \\
        /work/tools/vllm-slot .venv-vllm/bin/python tests/against_vllm/gptq_release_shapes.py

As tests/against_vllm/release_shapes.py (its recording, on 8 gloo CPU ranks, with and without EP), for
the GPTQ registry, with only the CPU kernel choice relaxed (vllm_patches.allow_gptq: vLLM CPU has no
WNA16 MoE kernel for these shapes). The layout choice stays vLLM's: at TP 8 Qwen3-30B-A3B's per-rank
intermediate size 96 is not a multiple of the group 128, so vLLM builds MoeWNA16Method's experts
(uint8, N-first); with EP (768 per rank) the Marlin layout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.against_vllm import release_shapes, vllm_ipc, vllm_patches, vllm_state  # noqa: E402
from tests.fixtures import gptq_releases  # noqa: E402

_rank = release_shapes._rank


def _gptq_rank(*args) -> None:
    vllm_patches.allow_gptq()
    _rank(*args)


_tokenizer = release_shapes._write_tokenizer


def _tokenizer_and_headers(model_dir: Path, n: int) -> None:
    """record() writes the cut config.json, then the tokenizer: the header-only tensors go beside them,
    since vLLM finds GPTQ's quantized modules in the checkpoint's headers (maybe_update_config; with none
    it would take the router for quantized)."""
    _tokenizer(model_dir, n)
    gptq_releases.write_header_only(model_dir, json.loads((model_dir / "config.json").read_text()))


def main(argv: list[str]) -> int:
    for k, v in vllm_state.VLLM_ENV.items():
        os.environ.setdefault(k, v)
    import vllm

    release_shapes.REGISTRIES = (gptq_releases,)
    release_shapes._rank = _gptq_rank  # the forked ranks call it by this name
    release_shapes._write_tokenizer = _tokenizer_and_headers
    with vllm_ipc.private_ipc_dir(os.environ):  # the forked ranks' sockets
        for release in argv or list(gptq_releases.RELEASES):
            res = release_shapes.record(release)
            res["vllm"] = vllm.__version__
            (gptq_releases.HERE / f"{release}.json").write_text(json.dumps(res, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
