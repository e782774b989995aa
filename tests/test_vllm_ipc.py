"""The vLLM harness's private IPC directory (tests/against_vllm/vllm_ipc.py): sockets a rank leaves go with it.

That vLLM binds its ZMQ sockets under VLLM_RPC_BASE_PATH is checked against vLLM itself in
tests/against_vllm/test_vllm_ipc.py; here, without vLLM, the directory's life cycle."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.against_vllm.vllm_ipc import VAR, private_ipc_dir

# what a forked vLLM rank does with its MessageQueue sockets: binds ipc://{VLLM_RPC_BASE_PATH}/{uuid4}, then
# os._exit without closing them (so nothing unlinks them)
_RANK = """
import os, socket, uuid
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4())))
print(s.getsockname(), flush=True)
os._exit(0)
"""


def test_the_sockets_a_rank_leaves_go_with_the_directory():
    env = {k: v for k, v in os.environ.items() if k != VAR}
    before = set(os.listdir(tempfile.gettempdir()))
    with private_ipc_dir(env) as path:
        assert env[VAR] == path
        assert Path(path).parent == Path(tempfile.gettempdir())
        assert len(path) + 1 + 36 < 108  # "<dir>/<uuid4>" fits in sockaddr_un
        out = subprocess.run([sys.executable, "-c", _RANK], env=env, capture_output=True, text=True, check=True)
        sock = Path(out.stdout.strip())
        assert sock.parent == Path(path) and sock.is_socket()
    assert VAR not in env
    assert not Path(path).exists()
    assert Path(path).name not in before
    assert Path(path).name not in os.listdir(tempfile.gettempdir())


def test_a_base_path_already_set_is_kept(tmp_path):
    env = {VAR: str(tmp_path)}
    with private_ipc_dir(env) as path:
        assert path == str(tmp_path)
        (tmp_path / "sock").touch()
    assert env == {VAR: str(tmp_path)}
    assert (tmp_path / "sock").exists()
