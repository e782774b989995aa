"""No network, a refused or unresolvable Hub, a slow-loris CDN (issue 24 papercuts), against the local Hub
server (tests/fixtures/hubserver.py): fail fast where waiting cannot help, fall back to a cached commit
at once, say each retry on stderr, and bound every request in time."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.fixtures.hubrun import REPO, run_reshard
from tests.fixtures.hubserver import HubServer


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from tests.fixtures.tiny import make_tiny

    return make_tiny("qwen3", tmp_path_factory.mktemp("hubnet") / "src", shards=2)


@pytest.fixture
def hub(src):
    server = HubServer().start()
    server.add_repo(REPO, src)
    yield server
    server.stop()


def closed_endpoint() -> str:
    """An address where nothing listens: the connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def reshard(endpoint: str, home: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    # RESHARD_HUB_BACKOFF 2: the default count of retries would wait 2+4+...+30 s = 2 min
    return run_reshard(endpoint, home, *args, timeout=timeout, **{"RESHARD_HUB_BACKOFF": "2", **env})


def test_refused_hub_uses_the_cached_commit_at_once(hub, tmp_path):
    home = tmp_path / "hf"
    p = reshard(hub.endpoint, home, "save", REPO, str(tmp_path / "first"), "--tp", "2")
    assert p.returncode == 0, p.stderr
    t0 = time.monotonic()
    p = reshard(closed_endpoint(), home, "save", REPO, str(tmp_path / "again"), "--tp", "2", timeout=30)
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 < 15
    assert "retrying" not in p.stderr
    assert (tmp_path / "again" / "reshard.json").is_file()


@pytest.mark.parametrize("endpoint", ["refused", "http://reshard-no-such-host.invalid"])
def test_unreachable_hub_without_a_cache_fails_fast(tmp_path, endpoint):
    endpoint = closed_endpoint() if endpoint == "refused" else endpoint
    t0 = time.monotonic()
    p = reshard(endpoint, tmp_path / "hf", "plan", REPO, "--tp", "2", timeout=30)
    assert p.returncode == 4, p.stderr
    assert time.monotonic() - t0 < 15
    assert p.stderr.count("\n") == 1 and "cannot reach the Hub" in p.stderr, p.stderr


def test_retries_are_said_on_stderr(hub, tmp_path):
    hub.errors = 2  # two CDN answers 503
    p = reshard(hub.endpoint, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2",
                RESHARD_HUB_BACKOFF="0.01")  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("reshard: retrying in ")]
    assert len(lines) == 2, p.stderr
    assert "(1/8)" in lines[0] and "503" in lines[0]


def test_slow_loris_cdn_is_bounded(hub, tmp_path):
    """A CDN that trickles bytes (never silent for RESHARD_HUB_TIMEOUT): each request has a deadline
    (RESHARD_HUB_MIN_SPEED after its first RESHARD_HUB_TIMEOUT), and such retries do not count as progress."""
    hub.rate, hub.block = 2000, 256  # 2 kB/s in 256-byte sends: the weights would take minutes
    t0 = time.monotonic()
    p = reshard(hub.endpoint, tmp_path / "hf", "save", REPO, str(tmp_path / "out"), "--tp", "2", "--stream",
                RESHARD_HUB_TIMEOUT="1", RESHARD_HUB_MIN_SPEED="100000", RESHARD_HUB_RETRIES="2",
                RESHARD_HUB_BACKOFF="0.01", timeout=90)  # fmt: skip
    assert p.returncode == 4, p.stderr
    assert "failed 3 times in a row" in p.stderr and "RESHARD_HUB_MIN_SPEED" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "out").exists()


def test_a_stalled_model_info_is_bounded(hub, tmp_path):
    """The Hub accepts the model-info request and never answers: RESHARD_HUB_TIMEOUT bounds it, retried,
    then exit 4 in one line (huggingface_hub's own default is no timeout: the run hung, silent)."""
    hub.api_stall = 60
    t0 = time.monotonic()
    p = reshard(hub.endpoint, tmp_path / "hf", "plan", REPO, "--tp", "2",
                RESHARD_HUB_TIMEOUT="1", RESHARD_HUB_RETRIES="1", RESHARD_HUB_BACKOFF="0.01", timeout=50)  # fmt: skip
    assert p.returncode == 4, p.stderr
    assert time.monotonic() - t0 < 20
    assert "model info" in p.stderr and "Timeout" in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1].startswith("reshard: error: "), p.stderr


@pytest.mark.parametrize("status, headers", [(500, {}), (429, {"Retry-After": "3600"})])
def test_small_files_are_retried_as_the_weights_are(hub, tmp_path, status, headers):
    """config.json answered 500, or 429 asking to wait an hour: reshard's retries (RESHARD_HUB_RETRIES, its
    backoff, one line each), then one error line; not huggingface_hub's minutes of its own retries."""
    hub.small_faults, hub.small_fault = 100, (status, headers)
    t0 = time.monotonic()
    p = reshard(hub.endpoint, tmp_path / "hf", "plan", REPO, "--tp", "2",
                RESHARD_HUB_RETRIES="2", RESHARD_HUB_BACKOFF="0.01", timeout=50)  # fmt: skip
    assert p.returncode == 4, p.stderr
    assert time.monotonic() - t0 < 20
    lines = p.stderr.splitlines()
    assert [line.startswith("reshard: retrying in ") for line in lines] == [True, True, False], p.stderr
    assert lines[-1].startswith("reshard: error: ") and "config.json" in lines[-1], p.stderr


def test_small_files_recover_from_a_few_failures(hub, tmp_path):
    hub.small_faults = 2
    p = reshard(hub.endpoint, tmp_path / "hf", "plan", REPO, "--tp", "2", RESHARD_HUB_BACKOFF="0.01")
    assert p.returncode == 0 and p.stderr.count("reshard: retrying in ") == 2, p.stderr


def test_a_file_its_cdn_lost_is_named_as_such(hub, src, tmp_path):
    """The commit lists the file, its CDN answers 404: not 'repository not found'."""
    name = sorted(p.name for p in src.glob("*.safetensors"))[0]
    hub.cdn_lost.add(name)
    p = reshard(hub.endpoint, tmp_path / "hf", "plan", REPO, "--tp", "2", RESHARD_HUB_BACKOFF="0.01")
    assert p.returncode == 4, p.stderr
    line = p.stderr.splitlines()[-1]
    assert name in line and "not found (HTTP 404), though the commit lists it" in line, p.stderr
    assert "repository not found" not in p.stderr
