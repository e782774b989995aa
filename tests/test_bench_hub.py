"""scripts/bench_hub.py (`python -m scripts.bench hub --doc`): its section replaces the earlier one
and leaves the sections after it in place."""

from __future__ import annotations

from scripts.bench_hub import HEADING, MARK, write_doc


def test_the_hub_section_is_replaced_and_the_sections_after_it_stay(tmp_path):
    doc = tmp_path / "benchmarks.md"
    before = "# Benchmarks\n\n## Commands\n\ncp -r A B\n\n"
    after = "## 6. What checking the source costs\n\nsix\n\n## 8. Scale\n\neight\n"
    doc.write_text(before + f"{MARK}\n{HEADING}\n\nold figures\n\n#### 2026-12-01\n\nold table\n\n" + after)
    new = f"{MARK}\n{HEADING}\n\nnew figures\n\n#### 2026-12-06\n\nnew table"
    write_doc(doc, new)
    assert doc.read_text() == before + new + "\n\n" + after


def test_the_hub_section_is_appended_to_a_file_without_one(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Commands\n\ncp -r A B\n")
    new = f"{MARK}\n{HEADING}\n\nfigures"
    write_doc(doc, new)
    assert doc.read_text() == "# Benchmarks\n\n## Commands\n\ncp -r A B\n\n" + new
