"""Hub -> S3 with --stream (the project's Hub server, SeaweedFS): the bytes go from the Hub into the
bucket's multipart uploads; local disk holds only the side files (config, tokenizer), never a weight."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.hubrun import REPO, rank_bytes, reshard, serving, tiny_with_reference
from tests.fixtures.s3out import BucketOut


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 3-shard tiny checkpoint and `save --tp 2` of it from the folder (the reference)."""
    return tiny_with_reference(tmp_path_factory.mktemp("hubs3src"), shards=3)


@pytest.fixture
def hub(source):
    with serving(source[0]) as server:
        yield server


def _bytes_under(*folders: Path) -> int:
    total = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for f in files:
                with contextlib.suppress(FileNotFoundError):  # removed while we looked
                    total += os.lstat(os.path.join(root, f)).st_size
    return total


class _Peak:
    """The most bytes seen under some folders, polled while a command runs."""

    def __init__(self, *folders: Path) -> None:
        self.folders, self.peak, self.stop = folders, 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _bytes_under(*self.folders))
            time.sleep(0.005)

    def __enter__(self) -> _Peak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _bucket_rank_bytes(out: BucketOut) -> dict[str, bytes]:
    run_id = out.manifest()["run_id"].encode()
    names = sorted(n for n in out.names() if n.startswith("model-rank-"))
    return {n: out.read(n).replace(run_id, b"0" * len(run_id)) for n in names}


def test_hub_to_bucket_streams_without_local_weights(hub, source, s3server, tmp_path):
    src, ref = source
    home, tmp = tmp_path / "hf", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    out = BucketOut(s3server.bucket(), "qwen/", s3server.client())
    env = {**s3server.env(), "TMPDIR": str(tmp)}
    with _Peak(home, tmp) as peak:
        p = reshard(hub, home, "save", REPO, out.url, "--tp", "2", "--stream", **env)
    assert p.returncode == 0, p.stderr
    assert _bucket_rank_bytes(out) == rank_bytes(ref)
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    sides = sum(f.stat().st_size for f in src.iterdir() if not f.name.endswith(".safetensors") and f.is_file())
    # the side files (in the hub cache, and in the temp folder they are patched and hashed in), never
    # a weight byte: at most twice the side files, and well under the smallest weight file
    assert peak.peak <= 2 * sides + 64 * 1024, (peak.peak, sides)
    assert peak.peak < min(f.stat().st_size for f in src.glob("*.safetensors")) < weights
    assert not list(home.rglob("*.safetensors")) and not list(tmp.iterdir())
    v = subprocess.run(
        [sys.executable, "-m", "reshard", "verify", out.url, "--deep"],
        env={**os.environ, **s3server.env()},
        capture_output=True,
        text=True,
    )
    assert v.returncode == 0, v.stdout + v.stderr
