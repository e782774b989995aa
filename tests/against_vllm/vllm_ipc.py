"""Where the vLLM processes this harness starts bind their ZMQ IPC sockets: a directory of their own, removed after.

vLLM (0.32 and 0.33 alike) binds ``ipc://{VLLM_RPC_BASE_PATH}/{uuid4}`` sockets (vllm/utils/network_utils.py
``get_open_zmq_ipc_path``): two per shared-memory MessageQueue (distributed/device_communicators/shm_broadcast.py,
one per TP group of more than one local rank, and the multiprocessing executor's broadcast) and the V1 engine's
input, output and handshake sockets. VLLM_RPC_BASE_PATH defaults to ``tempfile.gettempdir()``, and a rank that
ends with ``os._exit`` (the ranks this harness forks) or a kill never unlinks its sockets, so every case used to
leave a few ``srwxr-xr-x`` UUID-named sockets in /tmp: thousands after a day of runs.

    env = vllm_env()
    with private_ipc_dir(env):                # env["VLLM_RPC_BASE_PATH"]: a fresh directory
        subprocess.run([...], env=env)        # the directory goes, with whatever was left in it

Also for a process that runs vLLM itself: ``with private_ipc_dir(os.environ): ...`` (a forked rank leaves the
block only by ``os._exit``, so only the process that entered it removes the directory). A VLLM_RPC_BASE_PATH
already set is the caller's choice: kept, and nothing is removed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, MutableMapping

VAR = "VLLM_RPC_BASE_PATH"


@contextlib.contextmanager
def private_ipc_dir(env: MutableMapping[str, str]) -> Iterator[str]:
    """Point env's VLLM_RPC_BASE_PATH at a fresh directory (in the temp dir) for the block; then remove it."""
    if env.get(VAR):
        yield env[VAR]
        return
    # short: a socket's path ("<dir>/<36-character uuid>") must fit in AF_UNIX's 108 bytes
    path = tempfile.mkdtemp(prefix="vllm-ipc-")
    env[VAR] = path
    try:
        yield path
    finally:
        if env.get(VAR) == path:
            del env[VAR]
        shutil.rmtree(path, ignore_errors=True)
