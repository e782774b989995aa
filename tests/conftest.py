"""Shared fixtures: tiny real checkpoints (transformers from_config) built once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fixtures.s3out import s3, s3env  # noqa: F401 (fixtures: reshard in-process pointed at the S3 server)
from tests.fixtures.s3server import s3bucket, s3proxy, s3server  # noqa: F401 (fixtures: SeaweedFS, fault proxy)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch, **kwargs) -> folder of a tiny HF checkpoint, cached for the session."""
    from tests.fixtures.tiny import make_tiny

    cache: dict[tuple, Path] = {}

    def get(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            cache[key] = make_tiny(arch, tmp_path_factory.mktemp(name) / "src", **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """quantized(arch, scheme) -> a tiny checkpoint quantized as its tool writes `scheme`
    (tests/fixtures/quant.py: compressed-tensors, ModelOpt, NVFP4, GPTQ/AWQ), made once per session."""
    from tests.fixtures.quant import convert
    from tests.fixtures.tiny import make_tiny

    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, scheme: str) -> Path:
        if (arch, scheme) not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-{scheme}")
            cache[(arch, scheme)] = convert(make_tiny(arch, root / "bf16"), root / "src", scheme)
        return cache[(arch, scheme)]

    return get


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_delivered():
    """Tests send SIGINT to reshard (in-process and to subprocesses): a run started in the background
    (`make test &`, nohup) inherits SIGINT ignored, which Python and the children it starts keep, and
    the interrupt tests then saw reshard finish with exit 0. Restore the default, as in a terminal."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("RESHARD_DISABLE_PROGRESS", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)


@pytest.fixture(scope="session")
def clean(tiny, tmp_path_factory):
    """(source, output) of `save --tp 2` of the tiny llama; never modified (tests copy it: `out`)."""
    from reshard.plan import DEFAULT_MAX_PART
    from tests.fixtures.saving import save

    src = tiny("llama")
    out = tmp_path_factory.mktemp("clean") / "clean"
    save(str(src), out, tp=2, max_part_size=DEFAULT_MAX_PART)
    return src, out


@pytest.fixture
def out(clean, tmp_path):
    """A copy of `clean`'s output, free to damage."""
    dst = tmp_path / "out"
    shutil.copytree(clean[1], dst)
    return dst
