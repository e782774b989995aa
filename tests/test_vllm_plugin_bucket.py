"""`--load-format reshard` with `{"weights": "s3://bucket/prefix/"}` (reshard/vllm_plugin/remote.py), without
vLLM, against a real S3 server (SeaweedFS, tests/fixtures/s3server.py): the manifest and rank objects read
from the bucket with the local folder's checks (size, header, run, strays, the local config), the objects
streamed into tensors exactly (ranged GETs per stripe, whole GETs through the bounce buffer), a flipped
byte caught by the checksum, a download that breaks off resumed from the byte it reached. The loader on
real vLLM ranks and generation: tests/against_vllm/test_plugin.py."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.layout import Layout
from reshard.manifest import read_manifest
from reshard.names import MANIFEST
from reshard.vllm_plugin import checks, messages, reader, staged, striped
from reshard.vllm_plugin.checks import Engine, ReshardLoadError
from reshard.vllm_plugin.remote import BucketWeights

RANK1 = "model-rank-1-part-0.safetensors"


def _upload(client, bucket: str, folder: Path, prefix: str = "m/") -> str:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=bucket, Key=prefix + p.relative_to(folder).as_posix(), Body=p.read_bytes())
    return f"s3://{bucket}/{prefix}"


@pytest.fixture
def stored(clean, s3server, s3bucket, monkeypatch):
    """(url, local output): `clean`'s output uploaded to a fresh bucket; the AWS env points at the server."""
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    return _upload(s3server.client(), s3bucket, clean[1]), clean[1]


def _engine(folder: Path, rank: int = 1) -> Engine:
    lay = read_manifest(folder).layout
    return Engine(Layout(lay.tp, lay.pp, lay.ep, lay.dtype), None, "0.32.0", tp_rank=rank)


def _check(url: str, local: Path, rank: int = 1) -> tuple[BucketWeights, list[checks.RankFile]]:
    w = BucketWeights(url)
    m = w.manifest()
    e = _engine(local, rank)
    return w, w.check_objects(m, checks.rank_entries(m, e), e)


def _refused(url: str, local: Path) -> str:
    with pytest.raises(ReshardLoadError) as info:
        _check(url, local)
    msg = str(info.value)
    assert msg.startswith(f"--load-format reshard: {url} (rank 1): ") and "Nothing was loaded" in msg, msg
    assert msg.endswith(
        f"To fix: re-save the output to {url} (`reshard save SOURCE {url} --overwrite`), or restore the objects"
    )
    return msg


def _targets(files: list[checks.RankFile]) -> dict[str, torch.Tensor]:
    from reshard.format import DTYPE_CODES

    return {
        t.name: torch.full(t.shape, 7, dtype=getattr(torch, DTYPE_CODES.get(t.dtype, "float32")))
        for f in files
        for t in f.tensors
    }


def _read(w: BucketWeights, files, local: Path, threads: int = 4):
    targets = _targets(files)
    algo = read_manifest(local).checksum
    n, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=threads, log=print, label="rank 1", source=w)
    return n, bad, targets


def _same(targets: dict[str, torch.Tensor], local: Path, files) -> None:
    want = {k: v for f in files for k, v in load_file(local / f.path.name).items()}
    assert sorted(want) == sorted(targets)
    for k, v in want.items():
        assert torch.equal(targets[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k


def test_weights_option():
    opts = checks.parse_options({"weights": "s3://bucket/some/prefix"})
    assert opts.weights == "s3://bucket/some/prefix/" and opts.checksums and opts.strict
    assert checks.parse_options(None).weights is None
    for bad in ("gs://bucket/p/", "/local/folder", 3):
        with pytest.raises(ValueError, match='"weights" must be an s3://bucket/prefix/ URL'):
            checks.parse_options({"weights": bad})
    with pytest.raises(ValueError, match="is a bucket's root"):
        checks.parse_options({"weights": "s3://bucket/"})


@pytest.mark.parametrize(
    ("chunk", "stripe_min", "direct"),
    [(striped.CHUNK, reader.STRIPE_MIN, True), (4096, 8192, True), (4096, 4096, False)],
)
def test_objects_stream_into_every_tensor_exactly(stored, monkeypatch, chunk, stripe_min, direct):
    # small chunks and stripes: several ranged GETs per object, each read in many pieces; not direct
    # (the parameters of a GPU engine): the same GETs, through host buffers of the chunk's size
    monkeypatch.setattr(striped, "CHUNK", chunk)
    monkeypatch.setattr(staged, "SLOT", chunk)
    monkeypatch.setattr(reader, "STRIPE_MIN", stripe_min)
    if not direct:
        monkeypatch.setattr(reader, "_direct", lambda param, shape: False)
    url, local = stored
    w, files = _check(url, local)
    m = read_manifest(local)
    assert [f.path.name for f in files] == [e.name for e in m.files if e.tp_rank == 1]
    n, bad, targets = _read(w, files, local)
    assert bad == [] and n == sum(f.size for f in files)
    _same(targets, local, files)
    assert w.config_problems(local, w.manifest()) == []


def test_a_flipped_byte_in_the_bucket_is_caught(stored, s3server, monkeypatch):
    monkeypatch.setattr(striped, "CHUNK", 4096)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    url, local = stored
    bucket = url.split("/")[2]
    data = bytearray((local / RANK1).read_bytes())
    data[-3] ^= 0x10  # the last tensor's data: size and header unchanged, only the checksum can tell
    s3server.client().put_object(Bucket=bucket, Key="m/" + RANK1, Body=bytes(data))
    w, files = _check(url, local)
    _, bad, _ = _read(w, files, local)
    assert [b.name for b in bad] == [RANK1]
    assert bad[0].want == next(e.digest for e in read_manifest(local).files if e.name == RANK1) != bad[0].got


def test_missing_resized_stray_and_foreign_objects(stored, s3server):
    url, local = stored
    bucket, s3 = url.split("/")[2], s3server.client()
    body = (local / RANK1).read_bytes()
    s3.delete_object(Bucket=bucket, Key="m/" + RANK1)
    assert f"{RANK1} is missing" in _refused(url, local)
    s3.put_object(Bucket=bucket, Key="m/" + RANK1, Body=body[:-8])
    assert f"{RANK1} has {len(body) - 8} bytes, the manifest says {len(body)}" in _refused(url, local)
    s3.put_object(Bucket=bucket, Key="m/" + RANK1, Body=body)
    s3.put_object(Bucket=bucket, Key="m/model-rank-1-part-7.safetensors", Body=body)
    assert "model-rank-1-part-7.safetensors is not in the manifest" in _refused(url, local)
    s3.delete_object(Bucket=bucket, Key="m/model-rank-1-part-7.safetensors")
    s3.put_object(Bucket=bucket, Key="m/old/model-rank-1-part-7.safetensors", Body=body)  # not the folder's
    _check(url, local)
    m = json.loads((local / MANIFEST).read_text())
    m["run_id"] = "0" * 32
    s3.put_object(Bucket=bucket, Key="m/" + MANIFEST, Body=json.dumps(m).encode())
    assert "the manifest comes from another run" in _refused(url, local)


def test_no_manifest_and_another_config(stored, s3server, tmp_path):
    url, local = stored
    empty = f"s3://{url.split('/')[2]}/elsewhere/"
    with pytest.raises(ReshardLoadError, match=r"s3://.*/elsewhere/ has no reshard.json: not a complete reshard"):
        BucketWeights(empty).manifest()
    w = BucketWeights(url)
    m = w.manifest()
    config = tmp_path / "config"
    shutil.copytree(local, config, ignore=shutil.ignore_patterns("*.safetensors"))
    assert w.config_problems(config, m) == []
    c = json.loads((config / "config.json").read_text())
    c["num_hidden_layers"] += 1
    (config / "config.json").write_text(json.dumps(c))
    problems = w.config_problems(config, m)
    assert problems == [f"config.json differs from the one in {url}"]
    msg = w.config_message(config, problems)
    assert msg.endswith(f"`aws s3 cp --recursive --exclude '*.safetensors' {url} {config}`"), msg
    (config / "config.json").unlink()
    assert w.config_problems(config, m) == ["config.json is missing"]


def test_a_download_that_breaks_off_resumes(stored, s3server, s3proxy, monkeypatch):
    url, local = stored
    for k, v in s3server.env(endpoint=s3proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    w, files = _check(url, local)
    s3proxy.cut_response = 3  # three GETs break off half-way: each resumed with a ranged GET from the byte reached
    n, bad, targets = _read(w, files, local, threads=1)
    assert bad == [] and n == sum(f.size for f in files) and s3proxy.cut_response == 0
    _same(targets, local, files)
    gets = [q for q in s3proxy.log if q[0] == "GET" and not q[2]]
    assert len(gets) >= len(files) + 3, gets


def test_a_refused_download_is_one_read_error(stored, s3server, s3proxy, monkeypatch):
    """The store refuses the GETs after the checks (the credentials lost their rights): one line per
    the store's answer, no retry of a refusal, no thread left behind."""
    url, local = stored
    for k, v in s3server.env(endpoint=s3proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    w, files = _check(url, local)
    s3proxy.forbidden = 1000
    before = set(threading.enumerate())  # other tests' threads may still be winding down
    with pytest.raises(reader.ReadError) as info:
        _read(w, files, local)
    msg = str(info.value)
    assert msg.startswith(f"{url}model-rank-1-part-") and ": cannot read (access to " in msg, msg
    assert "denied (reading model-rank-1-part-" in msg and "\n" not in msg, msg
    assert 1000 - s3proxy.forbidden <= 4  # one GET per read stream, none retried
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("reshard-")]


def test_files_message_and_fix_name_the_bucket(clean):
    e = replace(_engine(clean[1]), tp_rank=0)
    msg = messages.files_message("s3://b/p/", e, ["x is missing"])
    assert msg.endswith(
        "To fix: re-save the output to s3://b/p/ (`reshard save SOURCE s3://b/p/ --overwrite`), or restore the objects"
    )


def test_the_listing_reads_every_page(stored, s3server):
    """vLLM's own listing reads one page (1000 keys); the plugin's every page: with one key per page, a
    stray on a page of its own is still found, and the rank's objects on theirs."""
    url, local = stored
    bucket, s3 = url.split("/")[2], s3server.client()
    pages = []

    class OneKeyPages:
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def get_paginator(self, name):
            real = self.client.get_paginator(name)

            class Paginator:
                def paginate(self, **kw):
                    for page in real.paginate(**kw, PaginationConfig={"PageSize": 1}):
                        pages.append(len(page.get("Contents", [])))
                        yield page

            return Paginator()

    w = BucketWeights(url, client=OneKeyPages(s3server.client()))
    m = w.manifest()
    e = _engine(local)
    assert [f.path.name for f in w.check_objects(m, checks.rank_entries(m, e), e)] == [RANK1]
    n = len(pages)
    assert n == len([p for p in local.rglob("*") if p.is_file()]) and set(pages) == {1}, pages
    s3.put_object(Bucket=bucket, Key="m/model-rank-1-part-9.safetensors", Body=b"x")
    with pytest.raises(ReshardLoadError, match=r"model-rank-1-part-9\.safetensors is not in the manifest"):
        w.check_objects(m, checks.rank_entries(m, e), e)
