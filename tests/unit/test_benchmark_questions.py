"""One current answer per benchmark question, and headlines that cannot drift from it.

docs/gen/questions.py names each question's canonical result file in benchmarks/results/ and
reads its headline from the JSON; the README's benchmark table and the benchmarks page are made
from it. These tests read files only (no benchmark runs).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "docs" / "gen"
RESULTS = ROOT / "benchmarks" / "results"
if str(GEN) not in sys.path:
    sys.path.insert(0, str(GEN))

import benchmarks_page  # noqa: E402
import questions  # noqa: E402

CKPT = "checkpoint_stall_cpu"


def test_readme_benchmark_table_is_the_one_the_result_files_give():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first, end = questions.readme_table_span(readme)
    assert readme.splitlines()[first:end] == questions.readme_table(RESULTS), (
        "README.md's benchmark table differs from benchmarks/results/: run "
        "`python docs/gen/questions.py --write-readme`"
    )


def test_a_changed_ratio_changes_the_readme_table_and_only_the_table(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for q in questions.QUESTIONS:
        if q.readme is not None:
            shutil.copy(RESULTS / f"{q.stem}.json", results)
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    before = readme.read_text(encoding="utf-8")
    assert not questions.write_readme(readme, results)  # current: nothing to rewrite

    doc = json.loads((results / f"{CKPT}.json").read_text())
    doc["over_sync"]["async_nice0"]["stall_s"] = 0.123
    (results / f"{CKPT}.json").write_text(json.dumps(doc))
    table = questions.readme_table(results)
    row = next(line for line in table if "benchmarks/checkpoint_stall.py" in line)
    assert "async blocks the loop 0.12x sync's time" in row

    assert questions.write_readme(readme, results)
    after = readme.read_text(encoding="utf-8")
    first, end = questions.readme_table_span(after)
    assert after.splitlines()[first:end] == table
    old, new = before.splitlines(), after.splitlines()
    assert old[:first] == new[:first] and old[end:] == new[end:]  # the rest untouched
    assert [a != b for a, b in zip(old, new, strict=True)].count(True) == 1


def test_every_result_file_is_a_questions_answer_its_source_or_archived():
    named = {q.stem for q in questions.QUESTIONS}
    sources = {s for q in questions.QUESTIONS for s in q.sources}
    assert {p.stem for p in RESULTS.glob("*.json")} == named | sources
    assert len(named) == len(questions.QUESTIONS)  # one question, one file
    archived = {p.stem for p in (RESULTS / "archive").glob("*.json")}
    assert archived == set(questions.ARCHIVE)
    assert set(questions.ARCHIVE.values()) <= named
    for q in questions.QUESTIONS:
        cmd = questions.command(questions.load(RESULTS, q.stem), q)
        scripts = re.findall(r"benchmarks/(\w+\.py)", cmd)
        assert scripts and all((ROOT / "benchmarks" / s).is_file() for s in scripts), (q.stem, cmd)


def test_page_opens_with_the_question_table_then_plot_first_and_raw_numbers_folded():
    page = benchmarks_page.render_benchmarks(RESULTS, asset_base="benchmarks/results")
    lines = page.splitlines()
    head = lines.index("| question | headline | spread | machine | date | command |")
    rows = lines[head + 2 : head + 2 + len(questions.QUESTIONS)]
    assert head < min(i for i, line in enumerate(lines) if line.startswith("## "))
    for q, row in zip(questions.QUESTIONS, rows, strict=True):
        doc = questions.load(RESULTS, q.stem)
        assert row.startswith("| [") and f"](#{q.stem.replace('_', '-')}) |" in row
        assert re.sub(r"\\(.)", r"\1", row).count(q.headline(doc).replace("<", "&lt;")) == 1
        section = page[page.index(f"{{#{q.stem.replace('_', '-')}}}") :]
        section = section[: section.find("\n## ")]
        fold = section.index(f'??? note "Raw numbers: {q.stem}.json"')
        if (RESULTS / f"{q.stem}.png").exists():
            assert section.index(f"![{q.stem}](benchmarks/results/{q.stem}.png)") < fold
        assert "\n    | " in section[fold:]  # the raw tables sit inside the fold
        assert "| --- |" not in section[:fold]  # and none before it
    summary = "\n".join(rows)
    for stem in questions.ARCHIVE:
        assert f"](benchmarks/results/archive/{stem}.json)" in page
        assert stem + ".json" not in summary
