"""What a bucket output's next run does with what killed runs left (its commit journal, its open uploads),
against a real S3 server (SeaweedFS): it finishes only a commit whose objects are all still there, it never
touches another output's uploads, and what it cannot read is a one-line refusal (exit 5), never exit 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.fixtures.cli import run
from tests.fixtures.s3out import one_line, url
from tests.fixtures.s3run import open_uploads, paused, prefix_state, reshard, s3_env

pytest.importorskip("boto3")


def _killed_in_commit(src: Path, bucket: str, prefix: str, s3server, tmp_path: Path) -> dict[str, str]:
    """A TP 2 output at `prefix`, then a `--tp 4 --overwrite` run killed while committing (its journal
    and open uploads left); the environment for the next runs."""
    env = s3_env(s3server, RESHARD_S3_CONCURRENCY="1")
    assert reshard(["save", str(src), url(bucket, prefix), "--tp", "2"], env).returncode == 0
    marker = tmp_path / f"stopped-{prefix.strip('/').replace('/', '-')}"
    p = paused(["save", str(src), url(bucket, prefix), "--tp", "4", "--overwrite"], env, at="completing", marker=marker)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.kill()
    p.communicate(timeout=60)
    return env


def test_a_refused_save_to_the_parent_leaves_a_killed_commits_uploads_to_it(tiny, s3, s3server, tmp_path):
    """The parent's run is refused (the child's rank files lie under it) and aborts nothing: the child's
    next run still finishes its commit."""
    client, bucket = s3
    src = tiny("llama")
    env = _killed_in_commit(src, bucket, "pc/child/", s3server, tmp_path)
    left = open_uploads(client, bucket, "pc/child/")
    assert left
    r = reshard(["save", str(tiny("qwen3")), url(bucket, "pc/"), "--tp", "2", "--overwrite"], env)
    assert r.returncode == 3 and "lies under" in one_line(r.stderr), r.stderr
    assert open_uploads(client, bucket, "pc/child/") == left
    r = reshard(["save", str(src), url(bucket, "pc/child/"), "--tp", "2"], env)
    assert "finished publishing the output of interrupted run" in r.stderr and r.returncode == 5, r.stderr
    state = prefix_state(client, bucket, "pc/child/")
    assert state.verifies and state.manifest["layout"]["tp"] == 4


def test_a_commit_whose_upload_was_aborted_outside_is_not_finished(tiny, s3, s3server, tmp_path):
    """A lifecycle rule aborted one of the killed commit's uploads: the next run must not publish a manifest
    over the files it has; it says so, and a save with --overwrite then writes a whole output."""
    client, bucket = s3
    src = tiny("llama")
    env = _killed_in_commit(src, bucket, "ab/", s3server, tmp_path)
    ups = client.list_multipart_uploads(Bucket=bucket, Prefix="ab/")["Uploads"]
    victim = next(u for u in ups if u["Key"].endswith(".safetensors"))
    client.abort_multipart_upload(Bucket=bucket, Key=victim["Key"], UploadId=victim["UploadId"])
    r = reshard(["save", str(src), url(bucket, "ab/"), "--tp", "2"], env)
    told, refused = r.stderr.strip().splitlines()
    assert "could not finish publishing the output of interrupted run" in told, r.stderr
    assert victim["Key"].removeprefix("ab/") in told
    assert r.returncode == 5 and "is not empty" in refused and "--overwrite" in refused, r.stderr
    state = prefix_state(client, bucket, "ab/")
    assert state.manifest is None and state.work == [] and state.uploads == []  # never a manifest over lost files
    r = reshard(["save", str(src), url(bucket, "ab/"), "--tp", "2", "--overwrite"], env)
    assert r.returncode == 0, r.stderr
    assert prefix_state(client, bucket, "ab/").verifies


JOURNALS = {
    "not JSON": b"not json",
    "an empty object": b"{}",
    "a list": b"[1, 2]",
    "a number for the manifest": b'{"run": "x", "uploads": [], "remove": [], "manifest": 5}',
    "a key outside the output to remove": json.dumps(
        {
            "run": "x",
            "uploads": [],
            "remove": ["elsewhere/precious.bin"],
            "manifest": {"key": "jj/reshard.json", "upload_id": "u", "size": 1, "parts": []},
        }
    ).encode(),
}


@pytest.mark.parametrize("case", JOURNALS)
def test_a_journal_reshard_did_not_write_is_refused_in_one_line(tiny, s3, case):
    client, bucket = s3
    src = tiny("llama")
    assert run("save", str(src), url(bucket, "jj/"), "--tp", "2")[0] == 0
    client.put_object(Bucket=bucket, Key="jj.reshard/commit.json", Body=JOURNALS[case])
    client.put_object(Bucket=bucket, Key="elsewhere/precious.bin", Body=b"keep me")
    code, out, err = run("save", str(src), url(bucket, "jj/"), "--tp", "2", "--overwrite", "--json")
    assert code == 5 and json.loads(out)["error"]["kind"] == "OutputError", (out, err)
    line = one_line(err)
    assert "jj.reshard/commit.json is not a reshard commit journal" in line and "delete it" in line
    assert prefix_state(client, bucket, "jj/").verifies  # the output there untouched
    assert client.get_object(Bucket=bucket, Key="elsewhere/precious.bin")["Body"].read() == b"keep me"


@pytest.mark.parametrize(
    "lock",
    [
        {"pid": 10**20, "since": 1},  # os.kill: OverflowError
        {"pid": 1, "since": 10**20},  # localtime: OverflowError
    ],
)
def test_lock_values_out_of_range_are_not_a_reshard_lock(tiny, s3, lock):
    import socket

    client, bucket = s3
    body = {"host": socket.gethostname(), "run": "x", **lock}
    client.put_object(Bucket=bucket, Key="lk.reshard/lock.json", Body=json.dumps(body).encode())
    code, _, err = run("save", str(tiny("llama")), url(bucket, "lk/"), "--tp", "2")
    assert code == 5 and "is not a reshard lock" in one_line(err), err


@pytest.mark.parametrize("prefix", ["col.reshard/", "col.reshard/inner/"])
def test_an_output_inside_another_outputs_work_folder_is_refused(tiny, s3, prefix):
    client, bucket = s3
    code, _, err = run("save", str(tiny("llama")), url(bucket, prefix), "--tp", "2")
    assert code == 3 and "where reshard keeps the lock and commit journal of col/" in one_line(err), err
    assert open_uploads(client, bucket) == []


def test_a_manifest_replaced_during_the_run_is_not_deleted(tiny, s3, s3server, tmp_path):
    """Another writer (a lock taken over as dead, a hand edit) put a manifest at the prefix while this run
    uploaded: the commit's withdrawal is conditional on the manifest it read, so it deletes nothing,
    publishes nothing and says so (exit 5); the other manifest stays and no upload is left open."""
    client, bucket = s3
    src = tiny("llama")
    env = s3_env(s3server)
    assert reshard(["save", str(src), url(bucket, "rp/"), "--tp", "2"], env).returncode == 0
    marker = tmp_path / "stopped"
    p = paused(["save", str(src), url(bucket, "rp/"), "--tp", "4", "--overwrite"], env, at="commit", marker=marker)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    theirs = client.get_object(Bucket=bucket, Key="rp/reshard.json")["Body"].read().replace(b"{", b"{ ", 1)
    client.put_object(Bucket=bucket, Key="rp/reshard.json", Body=theirs)
    marker.unlink()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 5 and "changed while this run uploaded" in one_line(err), err
    assert client.get_object(Bucket=bucket, Key="rp/reshard.json")["Body"].read() == theirs
    state = prefix_state(client, bucket, "rp/")
    assert state.uploads == [] and state.work == [], state.describe()


def test_an_output_published_inside_the_prefix_during_the_run_stops_its_commit(tiny, s3, s3server, tmp_path):
    """Two runs at once on nested prefixes (each holds its own lock): both checked a prefix free of the other
    at their start, and both published; vLLM would then load the inner output's rank files with the outer's.
    The outer run looks again before its commit: exit 3, nothing of it published, the inner output whole."""
    client, bucket = s3
    env = s3_env(s3server)
    marker = tmp_path / "stopped"
    outer = paused(["save", str(tiny("llama")), url(bucket, "n/"), "--tp", "2"], env, at="commit", marker=marker)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert outer.poll() is None and time.monotonic() < deadline, outer.communicate()
        time.sleep(0.02)
    inner = reshard(["save", str(tiny("qwen3")), url(bucket, "n/sub/"), "--tp", "2"], env)
    assert inner.returncode == 0, inner.stderr
    marker.unlink()
    _, err = outer.communicate(timeout=120)
    assert outer.returncode == 3 and "lies under s3://" in one_line(err) and "n/sub/model-rank-" in err, err
    assert "reshard.json" not in objects_named(client, bucket, "n/")
    assert prefix_state(client, bucket, "n/sub/").verifies and open_uploads(client, bucket, "n/") == []


def objects_named(client, bucket: str, prefix: str) -> set[str]:
    return {o["Key"][len(prefix) :] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}


def _stopped(p, marker: Path) -> None:
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)


def test_a_killed_runs_scratch_folder_is_removed_by_the_next_run_and_a_live_ones_kept(tiny, s3, s3server, tmp_path):
    """An S3 save keeps the side files it uploads in a folder of the temp folder (TMPDIR); one killed (SIGKILL)
    cannot remove it. The next run removes it; the folder of a run still going is left, and that run completes."""
    client, bucket = s3
    src = tiny("llama")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = s3_env(s3server, TMPDIR=str(scratch), RESHARD_S3_CONCURRENCY="1")
    killed = paused(["save", str(src), url(bucket, "sk/a/"), "--tp", "2"], env, at="upload", marker=tmp_path / "a")
    _stopped(killed, tmp_path / "a")
    left = sorted(p.name for p in scratch.iterdir())
    killed.kill()
    killed.communicate(timeout=60)
    live = paused(["save", str(src), url(bucket, "sk/b/"), "--tp", "2"], env, at="upload", marker=tmp_path / "b")
    _stopped(live, tmp_path / "b")
    held = sorted(p.name for p in scratch.iterdir() if p.name not in left)
    assert len(left) == 1 and len(held) == 1 and left[0].startswith("reshard-side"), (left, held)
    r = reshard(["save", str(src), url(bucket, "sk/c/"), "--tp", "2"], env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in scratch.iterdir()) == held
    (tmp_path / "b").unlink()  # the live run goes on
    _, err = live.communicate(timeout=120)
    assert live.returncode == 0 and prefix_state(client, bucket, "sk/b/").verifies, err
    assert list(scratch.iterdir()) == []
