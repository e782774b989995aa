"""The checksum a save records (`--checksum blake3|sha256|none`) and verify reads back by the
manifest's `checksum` field; manifests without the field hold sha256 digests and keep verifying."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import blake3
import pytest
from click.testing import CliRunner

from reshard.cli import cli
from reshard.hashing import ALGORITHMS, hash_bytes, hash_file, new_hasher
from reshard.manifest import ManifestProblem, parse
from reshard.plan import DEFAULT_MAX_PART
from reshard.sources import open_source
from reshard.verify import verify
from tests.fixtures.cli import run
from tests.fixtures.saving import save

RANK1 = "model-rank-1-part-0.safetensors"
REFERENCE = {"blake3": lambda b: blake3.blake3(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}


def manifest(out):
    return json.loads((out / "reshard.json").read_text())


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x5A
    path.write_bytes(bytes(data))


def test_api():
    assert ALGORITHMS[0] == "blake3"
    with pytest.raises(ValueError, match="md5"):
        new_hasher("md5")
    data = bytes(range(256)) * 1000
    for name, ref in REFERENCE.items():
        h = new_hasher(name)
        h.update(memoryview(data)[:1000])
        h.update(memoryview(data)[1000:])
        assert h.hexdigest() == hash_bytes(data, name) == ref(data)
    assert hash_bytes(data, "none") is None


def test_the_manifest_names_its_algorithm(clean):
    m = json.loads((clean[1] / "reshard.json").read_text())
    assert parse(m).checksum == "blake3" and parse(m).files[0].digest == m["files"][0]["blake3"]
    for f in m["files"] + m["copied_files"]:
        f["sha256"] = "ab"
    del m["checksum"]  # written before the field existed: sha256
    assert parse(m).checksum == "sha256" and parse(m).files[0].digest == "ab"
    with pytest.raises(ManifestProblem, match="md5"):
        parse({**m, "checksum": "md5"})
    with pytest.raises(ManifestProblem, match="holds a blake3 digest, but checksum is none"):
        parse({**m, "checksum": "none"})  # digests left in: a manifest edited to skip the checks
    bare = {
        key: [{k: v for k, v in f.items() if k not in ALGORITHMS} for f in m[key]] for key in ("files", "copied_files")
    }
    assert parse({**m, **bare, "checksum": "none"}).files[0].digest is None


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_digests_are_the_files_digests(tiny, tmp_path, algorithm):
    out = tmp_path / "o"
    save(str(tiny("qwen3-moe")), out, tp=2, max_part_size=150_000, checksum=algorithm)
    m = manifest(out)
    assert m["checksum"] == algorithm and len(m["files"]) > 2
    other = next(a for a in REFERENCE if a != algorithm)
    for e in m["files"] + m["copied_files"]:
        data = (out / e["name"]).read_bytes()
        assert e[algorithm] == REFERENCE[algorithm](data), e["name"]
        assert other not in e
        assert hash_file(out / e["name"], algorithm) == e[algorithm]
    report = verify(out)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["checksum"] == algorithm
    flip_last_byte(out / RANK1)
    report = verify(out)
    assert report.exit_code == 7
    assert any(f.kind == "checksum" and algorithm in f.message for f in report.findings)


def test_sha256_lines_check_with_sha256sum(tiny, tmp_path):
    """`--checksum sha256` digests are what `sha256sum -c` checks, in its own line format."""
    out = tmp_path / "o"
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART, checksum="sha256")
    lines = [f"{e['sha256']}  {e['name']}" for e in manifest(out)["files"]]
    for line in lines:
        digest, name = line.split("  ")
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest


def test_none_records_sizes_only(tiny, tmp_path):
    out = tmp_path / "o"
    result = CliRunner().invoke(
        cli, ["save", str(tiny("llama")), str(out), "--tp", "2", "--checksum", "none", "--json"]
    )
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["checksum"] == "none"
    assert all("sha256" not in e and "blake3" not in e for e in m["files"] + m["copied_files"])
    report = verify(out)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert [f.kind for f in report.warnings] == ["checksum"] and "not checked" in report.warnings[0].message
    flip_last_byte(out / RANK1)  # undetectable without checksums...
    assert verify(out).exit_code == 0
    with open(out / RANK1, "ab") as f:  # ...but a size change is
        f.write(b"x")
    assert verify(out).exit_code == 7
    # an output saved without checksums still serves as SOURCE (sizes checked)
    (out / RANK1).write_bytes((out / RANK1).read_bytes()[:-1])
    assert open_source(str(out)).checkpoint.tensors


def test_old_manifest_without_the_field_verifies_as_sha256(tiny, tmp_path):
    """A folder written before `checksum` was recorded: sha256 under each entry's `sha256`."""
    out = tmp_path / "o"
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART)
    m = manifest(out)
    del m["checksum"]
    for e in m["files"] + m["copied_files"]:
        del e["blake3"]
        e["sha256"] = hashlib.sha256((out / e["name"]).read_bytes()).hexdigest()
    (out / "reshard.json").write_text(json.dumps(m))
    report = verify(out)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["checksum"] == "sha256" and report.stats["hashed_bytes"] > 0
    assert open_source(str(out)).checkpoint.tensors  # usable as SOURCE too
    flip_last_byte(out / RANK1)
    report = verify(out)
    assert report.exit_code == 7 and any("sha256 differs" in f.message for f in report.findings)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: m.update(checksum="md5"), "md5"),
        (lambda m: m["files"][0].pop("blake3"), "files[0].blake3"),
        (lambda m: m["files"][0].update(blake3=7), "files[0].blake3"),
    ],
    ids=["unknown-algorithm", "digest-missing", "digest-not-a-string"],
)
def test_malformed_checksum_fields(tiny, tmp_path, edit, says):
    out = tmp_path / "o"
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART)
    m = manifest(out)
    edit(m)
    (out / "reshard.json").write_text(json.dumps(m))
    report = verify(out)
    assert report.exit_code == 7 and any(says in f.message for f in report.findings), report.findings


def test_deep_verify_hashes_with_the_manifest_algorithm(tiny, tmp_path):
    src = tiny("llama")
    for algorithm in ("sha256", "blake3"):
        out = tmp_path / algorithm
        save(str(src), out, tp=2, max_part_size=DEFAULT_MAX_PART, checksum=algorithm)
        report = verify(out, against=str(src), deep=True)
        assert report.exit_code == 0, [f.message for f in report.findings]
        assert "hashed_bytes" not in report.stats and report.stats["hashed_in_compare_bytes"] > 0
        assert all(f.entry and f.digest == f.entry.digest for f in report.files)


def test_pieces_with_different_checksums_are_not_assembled(tiny, tmp_path):
    src, out = tiny("llama"), tmp_path / "o"
    save(str(src), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0", checksum="sha256")
    with pytest.raises(Exception, match="different --checksum"):
        save(str(src), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="1", checksum="blake3")


def test_a_manifest_edited_to_checksum_none_is_malformed(clean, tmp_path):
    """`"checksum": "none"` over a manifest that still holds its digests, and a flipped byte: verify passed it
    with a warning that the folder was saved without checksums (it was not). Now exit 7, malformed."""
    out = Path(shutil.copytree(clean[1], tmp_path / "edited"))
    m = json.loads((out / "reshard.json").read_text())
    (out / "reshard.json").write_text(json.dumps({**m, "checksum": "none"}))
    rank = out / m["files"][0]["name"]
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    code, _, err = run("verify", str(out))
    assert code == 7 and "checksum is none" in err, err
