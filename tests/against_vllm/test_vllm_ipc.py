"""vLLM binds its ZMQ IPC sockets where the harness points VLLM_RPC_BASE_PATH (tests/against_vllm/vllm_ipc.py),
so a vLLM upgrade that renamed the variable would show here, not as sockets piling up in /tmp again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.against_vllm import vllm_ipc
from tests.against_vllm.vllm_state import vllm_env

_PATHS = """
from vllm.utils.network_utils import get_open_zmq_ipc_path
print(get_open_zmq_ipc_path())
"""


@pytest.mark.harness
def test_vllm_binds_its_ipc_sockets_in_the_private_directory():
    env = vllm_env()
    with vllm_ipc.private_ipc_dir(env) as path:
        out = subprocess.run([sys.executable, "-c", _PATHS], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        address = out.stdout.strip().splitlines()[-1]
        assert address.startswith("ipc://")
        assert Path(address.removeprefix("ipc://")).parent == Path(path)
    assert not Path(path).exists()
