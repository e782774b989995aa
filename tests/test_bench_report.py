"""scripts/bench_report.py (docs/benchmarks.md from `python -m scripts.bench`'s results): a section the run did
not measure (--skip-vllm, --skip-check, --skip-s3) keeps the text the file had for it, its date line with it;
a partial re-run dropped it, and the file had to be spliced by hand."""

from __future__ import annotations

import json

from scripts.bench import main
from scripts.bench_hub import MARK
from scripts.bench_report import report

MACHINE = {
    "nproc": 2,
    "cpu": "CPU",
    "ram": 2**34,
    "disk": "ext4",
    "uname": "Linux",
    "python": "3.11",
    "versions": "torch",
    "commit": "abc1234",
}
RUN = {
    "started": "2026-12-07T09:00:00",
    "minutes": 10.0,
    "machine": MACHINE,
    "load_start": [0.1],
    "load_end": [0.2],
    "disk": {"read": 1.0, "write": 1.2},
}
VLLM = {
    "tp": 2,
    "checkpoint": {"arch": "llama", "layers": 5, "bytes": 4 * 10**9},
    "rows": {"default": {"weights_med": 5.0, "weights": [5.0, 6.0], "ready_med": 20.0}},
}

# the sections of an earlier report this run does not measure: each with its own date, 7 followed by a section
# written by hand about its figures; the hub section's own "## 5." (after MARK) is not the report's section 5
FOUR = (
    "## 4. vLLM (CPU build) weight loading at T=2\n\nMeasured on 2026-11-01T01:00:00.\n\n| loader |\n|---|\n| x |\n\n"
)
FIVE = "## 5. Planning time\n\nbest of 3, 2026-11-02.\n\n| model |\n\n"
SIX = "## 6. What checking the source costs\n\n2026-11-03 08:19 UTC by `python -m scripts.bench check`.\n\n"
SEVEN = (
    "## 7. Saving to object storage\n\n2026-11-04 07:38 UTC by `python -m scripts.bench s3`.\n\n| save |\n\n"
    "## Object storage, by hand (2026-11-04)\n\nwhat section 7's ratio carries\n\n"
)
PREVIOUS = (
    "# Benchmarks\n\nWritten on 2026-11-01.\n\n## 0. The disk\n\nold disk\n\n"
    + FOUR
    + FIVE
    + SIX
    + SEVEN
    + "## Targets\n\nold targets\n\n## Commands\n\nold\n\n"
    + f"{MARK}\n## 5. `reshard save --tp 8 REPO` from a Hub server\n\nhub\n"
)


def test_a_section_the_run_skipped_keeps_its_previous_text():
    fresh = report(RUN)  # disk only: 4 to 7 skipped
    assert "## 4." not in fresh and "## 7." not in fresh
    assert report(RUN, PREVIOUS) == fresh.replace("## Targets", FOUR + FIVE + SIX + SEVEN + "## Targets", 1)


def test_a_section_the_run_measured_replaces_its_previous_text():
    run = {**RUN, "vllm": VLLM}
    fresh = report(run)
    assert "## 4. vLLM (CPU build) weight loading at T=2" in fresh and "Measured on 2026-12-07T09:00:00" in fresh
    assert report(run, PREVIOUS) == fresh.replace("## Targets", FIVE + SIX + SEVEN + "## Targets", 1)
    assert report(run, "") == fresh  # no earlier report: nothing to keep


def test_report_only_keeps_the_skipped_sections_of_the_file_it_rewrites(tmp_path):
    work, doc = tmp_path / "work", tmp_path / "benchmarks.md"
    work.mkdir()
    (work / "results.json").write_text(json.dumps(RUN))
    doc.write_text(PREVIOUS)
    assert main(["--report-only", "--work", str(work), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(report(RUN, PREVIOUS)) and SEVEN in text and text.endswith(PREVIOUS[PREVIOUS.index(MARK) :])
