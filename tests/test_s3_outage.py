"""A store that goes away for a few seconds mid-upload (a crash and restart, a failover) is outlasted.

Every part in flight fails at once then, over and over while the store is down. With botocore's standard
retry mode a save failed within a second (exit 5) whatever RESHARD_S3_RETRIES said: its per-client retry
budget (about 35 retries) was spent by the parts in flight, and its waits add up to 6 s on average.
reshard.store.client uses the legacy mode: no budget, waits of a random share of 1, 2, 4, ... s.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.fixtures.s3run import open_uploads, prefix_state, reshard, s3_env, synthetic_llama
from tests.fixtures.s3server import S3Server, weed_binary

MiB = 1 << 20


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 160 MB Llama-shaped checkpoint: at TP 2, two rank files of 16 parts of 5 MiB each."""
    sizes = dict(num_hidden_layers=6, hidden_size=1024, intermediate_size=3072, num_attention_heads=8)
    sizes.update(num_key_value_heads=4, head_dim=128, vocab_size=16384)
    return synthetic_llama(tmp_path_factory.mktemp("big") / "src", **sizes)


@pytest.mark.skipif(weed_binary() is None, reason="no SeaweedFS `weed` binary (`make test` installs it)")
def test_a_store_restarted_mid_upload_is_outlasted(big, tmp_path):
    server = S3Server(tmp_path / "weed").start()  # its own: killed here
    try:
        s3, bucket = server.client(), server.bucket()
        env = s3_env(server, RESHARD_S3_PART_SIZE=str(5 * MiB))
        target = f"s3://{bucket}/out/"
        p = subprocess.Popen(
            [sys.executable, "-m", "reshard", "save", str(big), target, "--tp", "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not open_uploads(s3, bucket) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        server.kill()  # every part in flight fails, and every retry, until it is back
        time.sleep(2)
        assert p.poll() is None, f"the save ended before the store came back: {p.communicate()}"
        server.start(same_ports=True)
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        check = reshard(["verify", target], env)
        assert check.returncode == 0, check.stderr
    finally:
        server.stop()


def test_a_withdrawal_delayed_past_the_commit_does_not_delete_the_new_manifest(tiny, s3server, s3proxy):
    """The previous manifest's DELETE is held by the network past the client's timeout: botocore retries
    it, the commit goes on and completes the new manifest, and then the first DELETE lands. Sent with
    If-Match the old manifest's ETag, it deletes nothing (it deleted the new manifest: exit 0, and then
    no output at the prefix)."""
    s3, bucket = s3server.client(), s3server.bucket()
    src, target = tiny("llama"), f"s3://{bucket}/late/"
    assert reshard(["save", str(src), target, "--tp", "2"], s3_env(s3server)).returncode == 0
    withdrawals = lambda: [e for e in s3proxy.log if e[0] == "DELETE" and e[1].endswith("/late/reshard.json")]  # noqa: E731
    s3proxy.only = lambda method, path, query: method == "DELETE" and path.endswith("/late/reshard.json")
    s3proxy.hold, s3proxy.hold_seconds = 1, 8.0
    slow = s3_env(s3server, endpoint=s3proxy.endpoint, RESHARD_S3_TIMEOUT="1")
    r = reshard(["save", str(src), target, "--tp", "4", "--overwrite"], slow)
    assert r.returncode == 0, r.stderr
    assert len(withdrawals()) == 1, "the held DELETE landed before the save ended: nothing was tested"
    deadline = time.monotonic() + 30
    while len(withdrawals()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(withdrawals()) == 2, s3proxy.log
    state = prefix_state(s3, bucket, "late/")
    assert state.verifies and state.manifest["layout"]["tp"] == 4, state.describe()
