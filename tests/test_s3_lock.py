"""The lock object of an s3:// output (reshard/store/lock.py): one run per prefix; a lock whose
run is gone (same host, pid dead) or that nobody rewrote for LOCK_STALE seconds is taken over."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest

from reshard.errors import OutputError
from reshard.store import lock, parse_bucket_url
from reshard.store import publish as pub
from reshard.store.bucket import Bucket
from tests.fixtures.cli import run


@pytest.fixture
def publisher(s3server, s3bucket, monkeypatch):
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    return pub.BucketPublisher(Bucket(parse_bucket_url(f"s3://{s3bucket}/model/")))


def plant(p: pub.BucketPublisher, host: str, pid: int) -> None:
    body = {"host": host, "pid": pid, "run": "other", "since": 0}
    p.bucket.put(p.lock_key, json.dumps(body).encode())


def held_by(p: pub.BucketPublisher) -> str:
    return json.loads(p.bucket.get(p.lock_key, limit=1 << 20))["run"]


def test_a_live_run_elsewhere_is_refused_naming_it(publisher):
    plant(publisher, "ci-runner-7", 4242)
    with pytest.raises(OutputError, match="host ci-runner-7, pid 4242") as e, publisher.locked("mine"):
        pass
    assert "taken over 5 minutes" in str(e.value)
    # how long ago its lock was rewritten (by the store's clock) tells a live run from one gone without deleting it
    said = re.search(r"its lock was last rewritten (\d+) s ago, every 30 s while it runs", e.value.message)
    assert said and int(said[1]) <= 5, e.value.message
    wait = re.search(r"after its last sign of life, in (\d) min (\d+) s \(or delete", e.value.hint or "")
    assert wait and 295 <= 60 * int(wait[1]) + int(wait[2]) <= 300, e.value.hint
    assert held_by(publisher) == "other"  # untouched


def test_a_dead_run_of_this_host_is_taken_over_and_released(publisher):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    plant(publisher, socket.gethostname(), dead)
    with publisher.locked("mine"):
        assert held_by(publisher) == "mine"
    assert publisher.bucket.head(publisher.lock_key) is None


def test_a_lock_nobody_rewrites_goes_stale(publisher, monkeypatch):
    plant(publisher, "ci-runner-7", 4242)
    monkeypatch.setattr(lock, "LOCK_STALE", -1)  # every lock is older than this
    with publisher.locked("mine"):
        assert held_by(publisher) == "mine"


def test_the_lock_is_rewritten_while_held(publisher, monkeypatch):
    monkeypatch.setattr(lock, "LOCK_BEAT", 0.05)
    writes = []
    real = publisher.bucket.put
    monkeypatch.setattr(publisher.bucket, "put", lambda key, data, **kw: (writes.append(key), real(key, data, **kw)))
    import time

    with publisher.locked("mine"):
        time.sleep(0.5)
    assert writes.count(publisher.lock_key) >= 3


def _lock_deletes(proxy, bucket: str) -> list[int]:
    """The statuses of the DELETEs of the lock of s3://BUCKET/model/ that went through `proxy` (0: dropped)."""
    return [e[3] for e in proxy.log if e[0] == "DELETE" and e[1] == f"/{bucket}/model.reshard/lock.json"]


def _faulty_lock_delete(proxy, monkeypatch, s3server, bucket: str, **faults) -> None:
    """reshard pointed at `proxy`, whose faults hit only the DELETEs of the lock (each request retried once)."""
    for k, v in s3server.env(endpoint=proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RESHARD_S3_RETRIES", "1")
    proxy.only = lambda method, path, query: method == "DELETE" and path == f"/{bucket}/model.reshard/lock.json"
    for k, v in faults.items():
        setattr(proxy, k, v)


def test_a_lock_delete_dropped_once_is_sent_again(tiny, s3server, s3bucket, s3proxy, monkeypatch):
    """A network blip drops the lock's DELETE at the end of a save: botocore sends it again (with backoff,
    RESHARD_S3_RETRIES times), so no lock is left for the next run to wait on, and nothing is said."""
    _faulty_lock_delete(s3proxy, monkeypatch, s3server, s3bucket, drop=1)
    code, _, err = run("save", str(tiny("llama")), f"s3://{s3bucket}/model/", "--tp", "2")
    assert code == 0, err
    assert _lock_deletes(s3proxy, s3bucket) == [0, 204]
    assert s3server.client().list_objects_v2(Bucket=s3bucket, Prefix="model.reshard/").get("KeyCount") == 0
    assert "lock.json" not in err


@pytest.mark.parametrize("fault, statuses", [("forbidden", [403]), ("slowdown", [503, 503])])
def test_a_lock_left_behind_is_said_with_the_command_that_deletes_it(
    tiny, s3server, s3bucket, s3proxy, monkeypatch, fault, statuses
):
    """The lock's DELETE still failing after botocore's retries (throttled throughout) or refused (403, not
    retried): the lock was left without a word, and a save from another host was refused for 5 minutes as
    if the finished run still wrote. The save still succeeds (its output is published); one note says the
    lock is left, what that costs and the command that deletes it; a run it refuses says how long ago the
    lock was last rewritten; once deleted as the note says, the next save goes ahead."""
    src, url = str(tiny("llama")), f"s3://{s3bucket}/model/"
    where = f"s3://{s3bucket}/model.reshard/lock.json"
    _faulty_lock_delete(s3proxy, monkeypatch, s3server, s3bucket, **{fault: 100})
    code, _, err = run("save", src, url, "--tp", "2")
    assert code == 0, err
    assert _lock_deletes(s3proxy, s3bucket) == statuses
    notes = [line for line in err.splitlines() if where in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: this run's lock {where} could not be deleted ("), err
    assert notes[0].endswith(
        f"): a save to {url} from another host is refused until it is 5 minutes old (one from this host takes it "
        f"over); delete it if no reshard run is writing there: aws s3 rm {where}"
    ), notes[0]
    client = s3server.client()
    lock = json.loads(client.get_object(Bucket=s3bucket, Key="model.reshard/lock.json")["Body"].read())
    lock["host"] = "ci-runner-7"  # as a run on another host finds it
    client.put_object(Bucket=s3bucket, Key="model.reshard/lock.json", Body=json.dumps(lock).encode())
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    code, _, err = run("save", src, url, "--tp", "2", "--overwrite")
    assert code == 5 and "its lock was last rewritten" in err and f"(or delete {where})" in err, err
    client.delete_object(Bucket=s3bucket, Key="model.reshard/lock.json")  # what the note says to run
    code, _, err = run("save", src, url, "--tp", "2", "--overwrite")
    assert code == 0, err
