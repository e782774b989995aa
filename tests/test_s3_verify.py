"""`reshard verify s3://bucket/prefix/` against a real S3 server (SeaweedFS): the checks a folder gets,
read with ranged GETs; vLLM's listing; the store's checksums (HEAD) by default, every byte with --deep."""

from __future__ import annotations

import json
import os

import pytest

from tests.fixtures.cli import run
from tests.fixtures.s3out import bucket_output

RANK0, RANK1 = "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"


@pytest.fixture
def saved(s3env, tiny):
    """The tiny llama saved at tp 2 to a fresh bucket."""
    return bucket_output(s3env, tiny("llama"), tp=2)


def _json(*args: str) -> tuple[int, dict, str]:
    code, out, err = run("verify", *args, "--json")
    return code, json.loads(out), err


def _one_error_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("reshard: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


def test_a_fresh_output_verifies_from_heads_and_header_reads(saved):
    code, rep, err = _json(saved.url)
    assert code == 0, (err, rep["findings"])
    assert rep["checked"] == ["manifest", "structure", "keys", "store-checksums"]
    assert rep["errors"] == 0 and rep["warnings"] == 0
    names = sorted(saved.names())
    # every object but the manifest compared with the store's checksum; none hashed (no --deep)
    assert rep["stats"]["store_checksums_checked"] == len(names) - 1
    assert "hashed_bytes" not in rep["stats"]
    assert sorted(f["name"] for f in rep["files"]) == [RANK0, RANK1]
    assert saved.manifest()["store_sha256"].keys() == set(names) - {"reshard.json"}


def test_deep_hashes_every_object(saved):
    code, rep, err = _json(saved.url, "--deep")
    assert code == 0, (err, rep["findings"])
    assert rep["checked"] == ["manifest", "structure", "keys", "store-checksums", "checksums"]
    m = saved.manifest()
    assert rep["stats"]["hashed_bytes"] == sum(f["size"] for f in m["files"])
    assert rep["stats"]["side_files_checked"] == len(m["copied_files"])


@pytest.mark.parametrize("how", ["plain", "sha256"])
def test_an_object_replaced_by_a_flipped_copy_fails_without_deep(saved, how):
    data = bytearray(saved.read(RANK1))
    data[-3] ^= 0x01  # a data byte: size and header unchanged
    saved.replace(RANK1, bytes(data), **({"ChecksumAlgorithm": "SHA256"} if how == "sha256" else {}))
    code, out, err = run("verify", saved.url)
    assert code == 7, (out, err)
    _one_error_line(err, RANK1, "replaced after it was written")


def test_a_manifest_re_uploaded_without_a_checksum_does_not_switch_the_check_off(saved, tmp_path):
    """`aws s3 cp reshard.json s3://...` (a plain PUT: no SHA256 on the manifest object) beside a flipped rank
    file: the objects the manifest records still report theirs, so the flipped one fails; re-sharding from
    the bucket refuses it too."""
    saved.flip(RANK0)
    saved.replace("reshard.json", saved.read("reshard.json"))
    code, out, err = run("verify", saved.url)
    assert code == 7, (out, err)
    _one_error_line(err, RANK0, "replaced after it was written")
    code, _, err = run("save", saved.url, str(tmp_path / "again"), "--tp", "1")
    assert code == 7 and "was replaced after it was written" in err, err


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note:")]


@pytest.mark.parametrize("deep", [False, True])
def test_a_flipped_byte_the_manifest_has_no_store_checksum_for_is_hashed(saved, deep):
    """An output whose manifest predates store checksums: HEADs cannot tell, so verify hashes every object
    against the manifest's digests (it passed with a warning, exit 0); --deep did already."""
    m = saved.manifest()
    del m["store_sha256"]
    saved.replace("reshard.json", json.dumps(m).encode(), ChecksumAlgorithm="SHA256")
    saved.flip(RANK0)
    code, rep, err = _json(saved.url, *(["--deep"] if deep else []))
    assert code == 7
    assert [(f["kind"], f["file"]) for f in rep["findings"]] == [("checksum", RANK0)]
    _one_error_line(err, RANK0, "differs from the manifest")
    said = [] if deep else ["the manifest records no store checksums"]
    assert [n.split(" (")[0] for n in rep["notes"]] == said and _notes(err) == []  # --json: in the object alone


def test_an_object_the_manifest_has_no_store_checksum_for_is_hashed_alone(saved):
    """A manifest whose `store_sha256` lacks one object (an edited manifest): that object was passed with a
    warning, unchecked; it is now hashed (it alone), so a flipped byte in it fails."""
    m = saved.manifest()
    del m["store_sha256"][RANK0]
    saved.replace("reshard.json", json.dumps(m).encode(), ChecksumAlgorithm="SHA256")
    saved.flip(RANK0)
    code, rep, err = _json(saved.url)
    assert code == 7 and [(f["kind"], f["file"]) for f in rep["findings"]] == [("checksum", RANK0)], err
    assert _notes(err) == [] and len(rep["notes"]) == 1
    assert rep["notes"][0].startswith(f"the manifest records no store checksum for {RANK0}: hashing {RANK0} ")
    assert rep["stats"]["hashed_bytes"] == next(f["size"] for f in m["files"] if f["name"] == RANK0)
    assert rep["stats"]["store_checksums_checked"] == len(m["store_sha256"])


def _hiding(proxy, monkeypatch, flip: str | None = None) -> None:
    """reshard pointed at `proxy`, which strips the x-amz-checksum-* headers of every answer (a store that keeps
    none, or a proxy that drops them) and, with `flip`, changes a data byte of that object in every GET."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.hide_checksums = True

    def lie(method: str, path: str, query: str, body: bytes) -> bytes:
        if flip is None or method != "GET" or not path.endswith("/" + flip) or len(body) < 1000:
            return body
        data = bytearray(body)
        data[-3] ^= 0x01  # a data byte of the object read whole: size and header unchanged
        return bytes(data)

    proxy.rewrite = lie


def test_a_store_that_reports_no_checksums_and_serves_other_bytes_fails(saved, s3proxy, monkeypatch):
    """The store stops reporting the objects' SHA256s and serves a changed rank file: verify passed it with a
    warning (exit 0); it now hashes every object against the manifest's blake3s, says so in one note (on
    stderr; with --json in the object's `notes` alone, as every command's --json), and fails (exit 7)."""
    _hiding(s3proxy, monkeypatch, flip=RANK1)
    code, out, err = run("verify", saved.url)
    assert code == 7, (out, err)
    _one_error_line(err, RANK1, "blake3 differs from the manifest")
    said = _notes(err)
    assert len(said) == 1 and "reports no SHA256 checksum for any object" in said[0], err
    assert "hashing 6 objects against the manifest's blake3 digests instead" in said[0]
    code, rep, err = _json(saved.url)
    assert code == 7 and rep["checked"] == ["manifest", "structure", "keys", "checksums"]
    assert [(f["kind"], f["file"]) for f in rep["findings"]] == [("checksum", RANK1)]
    assert rep["notes"] == [n.removeprefix("note: ") for n in said] and _notes(err) == []
    _one_error_line(err, RANK1, "blake3 differs from the manifest")
    names = set(saved.names()) - {"reshard.json"}
    assert rep["stats"]["store_checksums_missing"] == len(names) == 6
    m = saved.manifest()
    assert rep["stats"]["hashed_bytes"] == sum(f["size"] for f in m["files"])
    assert rep["stats"]["side_files_checked"] == len(m["copied_files"])


def test_a_store_that_reports_no_checksums_passes_once_hashed(saved, s3proxy, monkeypatch):
    """The same store serving the bytes as saved: exit 0, no warning (every byte was checked), the note."""
    _hiding(s3proxy, monkeypatch)
    code, _, err = run("verify", saved.url)
    said = _notes(err)
    assert code == 0 and len(said) == 1, err
    code, rep, err = _json(saved.url)
    assert code == 0 and rep["findings"] == [], (err, rep["findings"])
    assert "checksums" in rep["checked"] and "store-checksums" not in rep["checked"]
    assert rep["notes"] == [said[0].removeprefix("note: ")] and err == ""
    code, rep, err = _json(saved.url, "--deep")  # asked for: no note, and no "pass --deep" warning either
    assert code == 0 and rep["findings"] == [] and rep["notes"] == [] and _notes(err) == [], err
    assert "checksums" in rep["checked"]


def test_the_objects_a_store_cannot_vouch_for_are_hashed_with_progress(saved, s3proxy, monkeypatch):
    """The read that hashes what the store reports no checksum for shows its progress on stderr, as --deep's
    does (one line per 5 s, and the last, off a terminal); nothing under --json."""
    from reshard.console import human_bytes

    _hiding(s3proxy, monkeypatch)
    monkeypatch.setenv("RESHARD_DISABLE_PROGRESS", "0")
    size = human_bytes(sum(f["size"] for f in saved.manifest()["files"]))
    for args in ([], ["--deep"]):
        code, _, err = run("verify", saved.url, *args)
        lines = [line for line in err.splitlines() if not line.startswith("note:")]
        assert code == 0 and len(lines) == 1 and lines[0].startswith(f"hashing: {size} / {size} (100%, "), err
    code, _, err = run("verify", saved.url, "--json")
    assert (code, err) == (0, "")


def test_a_store_that_reports_no_checksums_of_a_checksum_none_output_warns(s3env, tiny, s3proxy, monkeypatch):
    """--checksum none: the manifest has no digests to hash against; a warning, exit 0, nothing hashed."""
    out = bucket_output(s3env, tiny("llama"), tp=2, checksum="none")
    _hiding(s3proxy, monkeypatch, flip=RANK1)
    code, rep, err = _json(out.url)
    assert code == 0 and _notes(err) == [] and rep["notes"] == [], err
    assert [(f["kind"], f["severity"]) for f in rep["findings"]] == [("store-checksum", "warning")]
    assert "--checksum none" in rep["findings"][0]["message"] and "--deep" not in rep["findings"][0]["message"]
    assert "hashed_bytes" not in rep["stats"] and "checksums" not in rep["checked"]


def test_a_flipped_side_file_fails(saved):
    config = saved.read("config.json")
    saved.flip("config.json", at=config.index(b'"silu"') + 1)  # "silu" -> "rilu": still valid JSON
    code, rep, _ = _json(saved.url)
    assert code == 7
    assert [(f["kind"], f["file"]) for f in rep["findings"]] == [("store-checksum", "config.json")]
    code, rep, _ = _json(saved.url, "--deep")
    assert ("checksum", "config.json") in [(f["kind"], f["file"]) for f in rep["findings"]]


def test_a_missing_object_fails_naming_it(saved):
    saved.delete(RANK1)
    code, rep, err = _json(saved.url)
    assert code == 7
    assert [(f["kind"], f["file"]) for f in rep["findings"] if f["severity"] == "error"] == [("missing-file", RANK1)]
    _one_error_line(err, RANK1, "missing")


def test_a_truncated_object_names_the_cut_tensor(saved):
    data = saved.read(RANK0)
    saved.replace(RANK0, data[: len(data) - 100])
    code, rep, _ = _json(saved.url)
    assert code == 7
    size = [f for f in rep["findings"] if f["kind"] == "size"]
    assert len(size) == 1 and size[0]["file"] == RANK0 and size[0]["tensor"], size
    assert "truncated" in size[0]["message"]


def test_a_rank_file_of_another_run_is_a_run_mix(s3env, tiny, saved):
    other = bucket_output(s3env, tiny("llama"), tp=2)
    saved.replace(RANK0, other.read(RANK0))
    code, rep, _ = _json(saved.url, "--no-checksums")
    assert code == 7
    assert [(f["kind"], f["file"]) for f in rep["findings"]] == [("run-mix", RANK0)]


def test_a_nested_rank_file_and_a_stray_are_errors(saved):
    saved.replace("old/" + RANK0, saved.read(RANK0))
    saved.replace("model-rank-2-part-0.safetensors", b"x")
    code, rep, _ = _json(saved.url)
    assert code == 7
    kinds = sorted((f["kind"], f["file"]) for f in rep["findings"])
    assert kinds == [("stray", "model-rank-2-part-0.safetensors"), ("stray", "old/" + RANK0)]


def test_an_output_nested_inside_is_an_error(saved):
    saved.replace("tp4/reshard.json", b"{}")
    code, rep, _ = _json(saved.url)
    assert code == 7
    assert [(f["kind"], f["file"]) for f in rep["findings"]] == [("nested", "tp4/reshard.json")]


def test_more_keys_than_vllm_lists_is_an_error(saved, monkeypatch):
    import reshard.verify.bucket as vb

    n = len(saved.names())
    monkeypatch.setattr(vb, "VLLM_MAX_KEYS", n)
    assert _json(saved.url)[0] == 0  # exactly the limit: vLLM sees everything
    saved.replace("notes.txt", b"hello")
    code, rep, err = _json(saved.url)
    assert code == 7
    assert [f["kind"] for f in rep["findings"]] == ["listing"]
    _one_error_line(err, f"{n + 1} objects", "first")


def test_against_the_source_and_deep_compare_from_the_bucket(saved, tiny):
    src = str(tiny("llama"))
    code, rep, err = _json(saved.url, "--against", src, "--deep")
    assert code == 0, (err, rep["findings"])
    assert "deep" in rep["checked"] and rep["stats"]["compared_bytes"] > 0
    data = bytearray(saved.read(RANK0))
    data[-3] ^= 0x01
    saved.replace(RANK0, bytes(data))
    code, rep, _ = _json(saved.url, "--against", src, "--deep")
    assert code == 7
    data_findings = [f for f in rep["findings"] if f["kind"] == "data"]
    assert len(data_findings) == 1 and data_findings[0]["file"] == RANK0 and data_findings[0]["tensor"]


def test_no_manifest_is_corrupt(s3env):
    bucket = s3env.bucket()
    code, _, err = run("verify", f"s3://{bucket}/nothing/")
    assert code == 7
    _one_error_line(err, "no reshard.json")


def test_a_missing_bucket_and_wrong_keys_exit_4_in_one_line(s3env, monkeypatch, saved):
    code, _, err = run("verify", "s3://no-such-bucket-here/m/")
    assert code == 4
    _one_error_line(err, "no-such-bucket-here", "does not exist")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    code, _, err = run("verify", saved.url)
    assert code == 4
    _one_error_line(err, "denied")


def test_other_schemes_are_refused(s3env):
    code, _, err = run("verify", "gs://bucket/m/")
    assert code == 3
    _one_error_line(err, "gs://")


@pytest.mark.parametrize(
    "var, value, says",
    [
        ("AWS_PROFILE", "nosuch", "AWS_PROFILE: The config profile (nosuch)"),
        ("AWS_ENDPOINT_URL", "not a url", "AWS_ENDPOINT_URL 'not a url' is not an http(s) URL"),
        ("AWS_ENDPOINT_URL", "s3://x", "AWS_ENDPOINT_URL 's3://x' is not an http(s) URL"),  # was exit 4/5
        ("AWS_ENDPOINT_URL_S3", "ftp://h", "AWS_ENDPOINT_URL_S3 'ftp://h' is not an http(s) URL"),
    ],
)
@pytest.mark.parametrize("command", ["save", "verify"])
def test_a_bad_aws_setting_is_a_usage_error(tiny, tmp_path, monkeypatch, var, value, says, command):
    """An AWS_PROFILE the config files lack, or an AWS_ENDPOINT_URL that is not an http(s) URL: exit 2 naming it (it
    was exit 1, an internal error, from botocore's ProfileNotFound / ValueError; `s3://x` or `ftp://h` were exit 4
    or 5 with botocore's `Custom endpoint ... was not a valid URI`, as a store that could not be reached)."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv(var, value)
    args = ["save", str(tiny("llama")), "s3://bucket1/out/"] if command == "save" else ["verify", "s3://bucket1/out/"]
    code, _, err = run(*args)
    assert code == 2 and says in err and err.count("\n") == 1, err
