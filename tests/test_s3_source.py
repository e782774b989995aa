"""A reshard output in a bucket read back as SOURCE (SeaweedFS): `save s3://OUT s3://NEW`, `save s3://OUT
LOCAL`, `merge s3://OUT HF_DIR`: the same bytes as from the local output, checked before and while it
is read, errors as one line: exit 7 for an output there that fails its checks, 4 for none there."""

from __future__ import annotations

import json

import pytest

from reshard.console import human_bytes
from reshard.store import view as store_view
from tests.fixtures.bytensor import read_by_tensor
from tests.fixtures.cli import run
from tests.fixtures.hubrun import rank_bytes
from tests.fixtures.s3out import BucketOut, bucket_output, lie_once
from tests.fixtures.saving import save

RANK0 = "model-rank-0-part-0.safetensors"


def _one_error_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("reshard: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


def _bucket_rank_bytes(out) -> dict[str, bytes]:
    run_id = out.manifest()["run_id"].encode()
    names = sorted(n for n in out.names() if n.startswith("model-rank-"))
    return {n: out.read(n).replace(run_id, b"0" * len(run_id)) for n in names}


@pytest.fixture
def saved(s3env, tiny):
    return bucket_output(s3env, tiny("llama"), tp=2)


@pytest.fixture
def local_tp4(tiny, tmp_path):
    """The tiny llama saved at tp 4 from the original checkpoint: what a re-shard must give."""
    out = tmp_path / "ref-tp4"
    save(str(tiny("llama")), out, tp=4)
    return out


def test_reshard_from_the_bucket_to_a_local_folder(saved, local_tp4, tmp_path):
    dst = tmp_path / "tp4"
    code, _, err = run("save", saved.url, str(dst), "--tp", "4")
    assert code == 0, err
    assert rank_bytes(dst) == rank_bytes(local_tp4)
    m = json.loads((dst / "reshard.json").read_text())
    assert m["source"]["url"] == saved.url and m["source"]["from_run"] == saved.manifest()["run_id"]
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in local_tp4.iterdir())
    assert run("verify", str(dst))[0] == 0


def test_reshard_from_one_bucket_prefix_to_another(s3env, saved, local_tp4):
    new = BucketOut(saved.bucket, "tp4/", saved.client)
    code, _, err = run("save", saved.url, new.url, "--tp", "4")
    assert code == 0, err
    assert _bucket_rank_bytes(new) == rank_bytes(local_tp4)
    code, out, err = run("verify", new.url, "--deep")
    assert code == 0, out + err


@pytest.mark.parametrize("where", ["model/", "model"])
def test_a_reshard_into_its_own_source_prefix_is_refused_as_for_a_folder(saved, where):
    """`save s3://B/model/ s3://B/model/ --overwrite` replaced the source with its re-shard (a folder into
    itself is exit 5, 'inside the source folder'; a prefix inside or around the source is exit 3, as another
    output there); now exit 5 too, before anything is written."""
    before = {n: saved.read(n) for n in saved.names()}
    code, out, err = run("save", saved.url, f"s3://{saved.bucket}/{where}", "--tp", "4", "--overwrite")
    assert (code, out) == (5, ""), err
    _one_error_line(err, "is inside the source", saved.url)
    assert {n: saved.read(n) for n in saved.names()} == before
    assert not saved.client.list_objects_v2(Bucket=saved.bucket, Prefix="model.reshard/").get("Contents")


def test_merge_from_the_bucket_equals_merge_from_the_folder(s3env, tiny, tmp_path):
    """A tp 1 output merged back: its one rank file is read in order, so it is hashed as it streams."""
    local = tmp_path / "tp1"
    save(str(tiny("llama")), local, tp=1)
    assert run("merge", str(local), str(tmp_path / "hf-local"))[0] == 0
    out = bucket_output(s3env, tiny("llama"), tp=1)
    code, _, err = run("merge", out.url, str(tmp_path / "hf-bucket"))
    assert code == 0, err
    assert "not hashed" not in err  # read whole in order: checked
    a, b = tmp_path / "hf-local", tmp_path / "hf-bucket"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert (b / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_flipped_byte_read_in_order_fails_the_merge(s3env, tiny, tmp_path):
    """Without store checksums in the manifest, the hash while streaming catches it (exit 7, as a local
    output failing its checksum; nothing written)."""
    out = bucket_output(s3env, tiny("llama"), tp=1)
    m = out.manifest()
    del m["store_sha256"]
    out.replace("reshard.json", json.dumps(m).encode())
    out.flip(RANK0)
    code, _, err = run("merge", out.url, str(tmp_path / "hf"))
    assert code == 7
    _one_error_line(err, RANK0, "checksum")
    assert not (tmp_path / "hf").exists()


def test_an_object_replaced_since_the_save_is_refused_before_reading(saved, tmp_path):
    saved.flip(RANK0)
    code, _, err = run("save", saved.url, str(tmp_path / "tp4"), "--tp", "4")
    assert code == 7
    _one_error_line(err, RANK0, "replaced after it was written")
    assert not (tmp_path / "tp4").exists()


def test_a_missing_or_truncated_object_is_refused(saved, tmp_path):
    data = saved.read(RANK0)
    saved.replace(RANK0, data[:-10])
    code, _, err = run("merge", saved.url, str(tmp_path / "hf"))
    assert code == 7
    _one_error_line(err, RANK0, f"{len(data) - 10} bytes")
    saved.delete(RANK0)
    code, _, err = run("merge", saved.url, str(tmp_path / "hf"))
    assert code == 7
    _one_error_line(err, RANK0, "missing")


@pytest.mark.parametrize("edit", ["not json", "tp out of bounds", "config.json altered"])
def test_a_malformed_manifest_or_altered_side_file_is_exit_7_as_for_a_folder(saved, tmp_path, edit):
    """The exit-code table: an output used as SOURCE that verify would call malformed or altered is
    exit 7, from a bucket as from a folder (exit 4 is for no output there at all)."""
    if edit == "not json":
        saved.replace("reshard.json", b"{not json")
    elif edit == "tp out of bounds":
        m = saved.manifest()
        m["layout"]["tp"] = 99999
        saved.replace("reshard.json", json.dumps(m).encode())
    else:
        saved.replace("config.json", saved.read("config.json") + b" ")
    code, _, err = run("merge", saved.url, str(tmp_path / "hf"))
    assert code == 7, err
    assert not (tmp_path / "hf").exists()


def test_not_an_output_and_no_bucket_exit_4(s3env, tmp_path):
    empty = s3env.bucket()
    code, _, err = run("save", f"s3://{empty}/none/", str(tmp_path / "x"), "--tp", "2")
    assert code == 4
    _one_error_line(err, "no reshard.json")
    code, _, err = run("merge", "s3://no-such-bucket-here/m/", str(tmp_path / "hf"))
    assert code == 4
    _one_error_line(err, "does not exist")


def test_throttled_range_reads_are_retried(s3server, saved, local_tp4, tmp_path, s3proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3proxy.endpoint)
    s3proxy.only = lambda method, path, query: method == "GET" and RANK0 in path
    s3proxy.slowdown = 3
    dst = tmp_path / "tp4"
    code, _, err = run("save", saved.url, str(dst), "--tp", "4")
    assert code == 0, err
    assert s3proxy.slowdown == 0 and [s for m, p, q, s in s3proxy.log if s == 503] == [503] * 3
    assert rank_bytes(dst) == rank_bytes(local_tp4)


def test_a_small_object_whose_body_breaks_off_is_read_again(saved, tmp_path, s3proxy, monkeypatch):
    """The manifest and config.json are read whole in one GET: a body cut short (botocore hands a short
    read over as it is) is asked for again, not parsed as a malformed manifest or an altered config;
    cut on every try, it is the store's failure (exit 4, a source that cannot be read), not a damaged
    output's (7)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3proxy.endpoint)
    small = ("/reshard.json", "/config.json")
    s3proxy.only = lambda method, path, query: method == "GET" and path.endswith(small)
    s3proxy.cut_response = 2
    code, _, err = run("merge", saved.url, str(tmp_path / "hf"))
    assert code == 0, err
    assert s3proxy.cut_response == 0
    code, out, err = run("verify", saved.url)
    assert code == 0 and "warning" not in out, out + err
    monkeypatch.setenv("RESHARD_S3_RETRIES", "1")
    s3proxy.cut_response = 2
    code, _, err = run("merge", saved.url, str(tmp_path / "hf2"))
    assert code == 4, err
    _one_error_line(err, "reshard.json", "broke off")


RANK1 = "model-rank-1-part-0.safetensors"


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note:")]


def _strip_checksums(proxy, monkeypatch) -> None:
    """reshard pointed at `proxy`, which strips the x-amz-checksum-* headers (a store that keeps none)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.hide_checksums = True


@pytest.mark.parametrize("command", ["save", "merge"])
def test_a_store_that_reports_no_checksums_and_serves_other_bytes_fails(saved, tmp_path, s3proxy, monkeypatch, command):
    """The store reports no SHA256 for the objects and serves a rank file with a flipped byte, read by tensor:
    the re-shard and the merge wrote the wrong bytes with exit 0, saying "store checksums were checked". The
    rank files the store cannot vouch for are now hashed in a second read before anything is published: exit 7,
    nothing written, one note saying so."""
    saved.flip_tensor(RANK1)
    _strip_checksums(s3proxy, monkeypatch)
    read_by_tensor(monkeypatch)
    dst = tmp_path / "dst"
    args = ["save", saved.url, str(dst), "--tp", "4"] if command == "save" else ["merge", saved.url, str(dst)]
    code, _, err = run(*args)
    assert code == 7, err
    _one_error_line(err, RANK1, "fails its blake3 checksum")
    assert not dst.exists()
    notes = _notes(err)
    assert len(notes) == 1 and "reports no SHA256 checksum for any object" in notes[0], err
    size = sum(f["size"] for f in saved.manifest()["files"])
    assert f"hashing 2 rank files ({human_bytes(size)}) against the manifest's blake3 digests" in notes[0]
    code, out, err = run(*args, "--json")  # the note in the failure's object, stderr the error line alone
    assert code == 7 and json.loads(out)["notes"] == [n.removeprefix("note: ") for n in notes], out
    _one_error_line(err, RANK1, "fails its blake3 checksum")
    assert len(err.splitlines()) == 1, err


def test_a_store_that_reports_no_checksums_passes_unchanged_bytes(saved, local_tp4, tmp_path, s3proxy, monkeypatch):
    """The same store serving the bytes as written: the second read passes, the re-shard is the one from the
    original checkpoint."""
    _strip_checksums(s3proxy, monkeypatch)
    read_by_tensor(monkeypatch)
    dst = tmp_path / "tp4"
    code, out, err = run("save", saved.url, str(dst), "--tp", "4", "--json")
    assert code == 0, err
    assert rank_bytes(dst) == rank_bytes(local_tp4)
    notes = json.loads(out)["notes"]  # --json: in the object, not on stderr
    assert "hashing 2 rank files" in notes[0] and err == "", (notes, err)
    code, out, err = run("merge", saved.url, str(tmp_path / "hf"), "--json")
    assert code == 0 and json.loads(out)["notes"] == notes[:1] and err == "", (out, err)


def test_a_store_that_reports_checksums_is_not_read_twice(saved, local_tp4, tmp_path, s3proxy, monkeypatch):
    """The normal path: the store vouches for every object (SHA256 as recorded), so rank files read by tensor
    are not read again, and the note says they were not hashed."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3proxy.endpoint)
    read_by_tensor(monkeypatch)
    dst = tmp_path / "tp4"
    code, _, err = run("save", saved.url, str(dst), "--tp", "4")
    assert code == 0, err
    assert rank_bytes(dst) == rank_bytes(local_tp4)
    assert [n.split(" (")[0] for n in _notes(err)][:1] == [
        "note: 2 of 2 rank files were read by tensor, not whole in order: their bytes were not hashed"
    ]
    assert "hashing" not in err


def test_a_rank_file_the_manifest_has_no_store_checksum_for_is_hashed_alone(saved, tmp_path, monkeypatch):
    """A manifest whose `store_sha256` lacks one rank file (an edited manifest) beside that file flipped: it was
    read unchecked (exit 0); it is now hashed, it alone, and fails (exit 7)."""
    m = saved.manifest()
    del m["store_sha256"][RANK1]
    saved.replace("reshard.json", json.dumps(m).encode(), ChecksumAlgorithm="SHA256")
    saved.flip_tensor(RANK1)
    read_by_tensor(monkeypatch)
    code, _, err = run("merge", saved.url, str(tmp_path / "hf"))
    assert code == 7, err
    _one_error_line(err, RANK1, "fails its blake3 checksum")
    size = next(f["size"] for f in m["files"] if f["name"] == RANK1)
    [note] = _notes(err)
    assert note.startswith(
        f"note: the manifest records no store checksum for {RANK1}: hashing {RANK1} ({human_bytes(size)}) against "
        "the manifest's blake3 digests from the bytes read, reading the "
    ), err


def test_an_output_without_digests_on_a_store_without_checksums_is_said_unchecked(
    s3env, tiny, tmp_path, s3proxy, monkeypatch
):
    """Saved with --checksum none and served without store checksums: nothing can check the bytes; the merge
    goes on (exit 0) and says so, where it said nothing."""
    out = bucket_output(s3env, tiny("llama"), tp=2, checksum="none")
    _strip_checksums(s3proxy, monkeypatch)
    code, _, err = run("merge", out.url, str(tmp_path / "hf"))
    assert code == 0, err
    assert _notes(err) == [
        "note: the object store reports no SHA256 checksum for any object (copied to a store that keeps none, or a "
        "proxy that strips them?), and the manifest records no digests (saved with --checksum none): the bytes of "
        "2 rank files are read unchecked (their sizes were checked)"
    ]


@pytest.mark.parametrize("command", ["save", "merge"])
def test_a_store_that_serves_other_bytes_once_fails(saved, tmp_path, s3proxy, monkeypatch, command):
    """The store reports no checksums and serves a flipped byte to the first ranged GET of a tensor of a rank
    file, the written bytes afterwards: the rank file read again whole at the end passed, and the re-shard or
    merge wrote the flipped byte with exit 0. The check now hashes the bytes the save used: exit 7, nothing
    written."""
    _strip_checksums(s3proxy, monkeypatch)
    read_by_tensor(monkeypatch)
    told = lie_once(s3proxy, saved, RANK1)
    dst = tmp_path / "dst"
    code, _, err = run(
        *(["save", saved.url, str(dst), "--tp", "4"] if command == "save" else ["merge", saved.url, str(dst)])
    )
    assert len(told) == 1, err
    assert code == 7, err
    _one_error_line(err, RANK1)
    assert not dst.exists()


def test_a_store_without_checksums_serves_each_rank_byte_once(saved, local_tp4, tmp_path, s3proxy, monkeypatch):
    """Re-sharding from a store that reports no checksums, read by tensor: the rank files were read again whole
    for the hash after the tensor reads; now the hash is fed the bytes read (the header, each tensor's), and only
    what no read needed (padding) is read at the end: every rank byte is served once (the header read asks for no
    more than its header here), and the output is the original's."""
    _strip_checksums(s3proxy, monkeypatch)
    read_by_tensor(monkeypatch)
    monkeypatch.setattr(store_view, "_FIRST", 8)
    dst = tmp_path / "tp4"
    code, _, err = run("save", saved.url, str(dst), "--tp", "4")
    assert code == 0, err
    assert rank_bytes(dst) == rank_bytes(local_tp4)
    files = saved.manifest()["files"]
    served = {path.rsplit("/", 1)[1]: n for path, n in s3proxy.served.items() if "/model-rank-" in path}
    assert served == {f["name"]: f["size"] for f in files}


def test_a_store_without_checksums_merges_as_the_folder_does(saved, tiny, tmp_path, s3proxy, monkeypatch):
    """The honest store without checksums, read by tensor: the merge checks the bytes it read and writes what a
    merge of the same output in a folder writes."""
    local = tmp_path / "tp2"
    save(str(tiny("llama")), local, tp=2)
    assert run("merge", str(local), str(tmp_path / "hf-local"))[0] == 0
    _strip_checksums(s3proxy, monkeypatch)
    read_by_tensor(monkeypatch)
    code, _, err = run("merge", saved.url, str(tmp_path / "hf-bucket"))
    assert code == 0, err
    a, b = tmp_path / "hf-local", tmp_path / "hf-bucket"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert (b / p.name).read_bytes() == p.read_bytes(), p.name
