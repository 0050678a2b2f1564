"""Benchmarks page: one current answer per question, its raw numbers folded below it.

The questions and their canonical result files are listed in questions.py: the page opens with
a table of them (headline ratio, spread, machine, date, command), then gives each a section:
its plot, its headline, its command and its files, then its JSON rendered as tables in a
collapsed block. Results in `archive/` are listed at the end, linked, never headlined. A result
file that no question names gets a plain section of its own (the unit tests keep none such in
`benchmarks/results/`).

The result files have no common schema (each benchmark script writes what its question needs),
so the layout is read from the shape of the JSON alone, never from the `.md` notes beside them:

- long top-level strings (`question`, `note`, ...) become paragraphs, `command` a code block;
- scalars, short lists of scalars and dicts made only of those go into one key/value table,
  nested keys dotted (`machine.cpus`);
- a list of dicts, or a dict of dicts, becomes a table: one row per entry, nested dicts
  flattened to dotted column names; a `{median, min, max}` dict is one cell `m (lo – hi)`;
  tables wider than `MAX_COLUMNS` are split, repeating the columns that name a row;
- other dicts become sub-sections; a sub-section of several tables (per-repeat records) is
  folded into a collapsed block; what nests deeper than `MAX_DEPTH` or is a long list is
  named in a note and left to the raw JSON, which the page links beside each heading.

A PNG with the same stem as a JSON is shown under its heading; the hook adds the PNG and JSON
files to the site (`result_assets`), archive/ included.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import questions
from mdtext import code, escape, prose, slug, table

MAX_COLUMNS = 8  # value columns per table; a wider one is split
MAX_ROWS = 60  # rows per table; the rest is left to the raw JSON
MAX_LIST_IN_CELL = 4  # scalars of a list shown inline in a table cell
MAX_LIST_IN_KV = 10  # ... and in the key/value table
MAX_DEPTH = 2  # sub-section levels below a result's heading
MAX_FLATTEN = 2  # dict levels flattened into dotted column names
TEXT_KEYS = ("question", "note", "encoding", "description")
LONG_TEXT = 80  # a top-level string this long is a paragraph, not a table cell
STAT_KEYS = frozenset({"median", "min", "max"})
ARCHIVE_DIR = "archive"  # superseded and exploratory results, under results/


def fmt_number(x: float | int) -> str:
    """4 significant digits for fractional numbers; integers (and integral floats such as byte
    counts) in full; thousands separated by commas."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return f"{x:,}"
    if not math.isfinite(x) or abs(x) >= 1e15:
        return f"{x:.4g}"
    if not x.is_integer():
        if abs(x) < 1e-3:
            return f"{x:.3e}"
        x = float(f"{x:.4g}")
        if not x.is_integer():
            return f"{x:.4g}"
    return f"{int(x):,}"


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def _is_stat(v: Any) -> bool:
    """`{"median": m, "min": lo, "max": hi}` (a `runs` list beside them is allowed)."""
    return (
        isinstance(v, dict)
        and v.keys() >= STAT_KEYS
        and v.keys() <= STAT_KEYS | {"runs"}
        and all(isinstance(v[k], int | float) for k in STAT_KEYS)
    )


def _scalar_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool | int | float):
        return fmt_number(v)
    return escape(str(v))


def cell(v: Any, max_list: int) -> str | None:
    """`v` as the text of one table cell, or None when it does not fit in one."""
    if _is_scalar(v):
        return _scalar_text(v)
    if _is_stat(v):
        return f"{fmt_number(v['median'])} ({fmt_number(v['min'])} – {fmt_number(v['max'])})"
    if isinstance(v, list) and len(v) <= max_list and all(_is_scalar(x) for x in v):
        return ", ".join(_scalar_text(x) for x in v) if v else "[]"
    if isinstance(v, dict) and not v:
        return "{}"
    return None


def _is_number_cell(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) or _is_stat(v)


@dataclass
class Flat:
    cells: dict[str, str] = field(default_factory=dict)
    numeric: dict[str, bool] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def flatten(d: dict[str, Any], max_list: int, prefix: str = "", depth: int = 0) -> Flat:
    """Dotted key -> cell text for everything in `d` that fits in a cell."""
    out = Flat()

    def visit(node: dict[str, Any], pre: str, level: int) -> None:
        for k, v in node.items():
            name = f"{pre}{k}"
            text = cell(v, max_list)
            if text is not None:
                out.cells[name] = text
                out.numeric[name] = _is_number_cell(v)
            elif isinstance(v, dict) and level < MAX_FLATTEN:
                visit(v, f"{name}.", level + 1)
            else:
                out.dropped.append(name)

    visit(d, prefix, depth)
    return out


def _records(v: Any) -> list[tuple[str | None, dict[str, Any]]] | None:
    """A list of dicts, or a dict of dicts, as (row name or None, record) pairs."""
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return [(None, x) for x in v]
    table_like = isinstance(v, dict) and v and not _is_stat(v)
    if table_like and all(isinstance(x, dict) for x in v.values()):
        return [(str(k), x) for k, x in v.items()]
    return None


def _fits_kv(v: Any, depth: int = 0) -> bool:
    """True when `v` goes whole into the key/value table (dicts of cells, a few levels)."""
    if cell(v, MAX_LIST_IN_KV) is not None:
        return True
    return isinstance(v, dict) and depth < 3 and all(_fits_kv(x, depth + 1) for x in v.values())


def _group(column: str) -> str:
    return column.split(".", 1)[0]


def _chunks(columns: list[str]) -> list[list[str]]:
    """Columns split into tables of at most MAX_COLUMNS (a table only a little wider is kept
    whole), keeping the columns of one dotted group (`median_s.*`) together where they fit."""
    if len(columns) <= MAX_COLUMNS + 2:
        return [columns] if columns else []
    groups: dict[str, list[str]] = {}
    for c in columns:
        groups.setdefault(_group(c), []).append(c)
    chunks: list[list[str]] = [[]]
    for cols in groups.values():
        if chunks[-1] and len(chunks[-1]) + len(cols) > MAX_COLUMNS and len(cols) <= MAX_COLUMNS:
            chunks.append([])
        for c in cols:
            if len(chunks[-1]) >= MAX_COLUMNS:
                chunks.append([])
            chunks[-1].append(c)
    return chunks


def _dropped_note(names: list[str]) -> str:
    listed = ", ".join(code(n) for n in names)
    return f"Not shown here (long lists or deeper nesting): {listed}."


def render_records(records: list[tuple[str | None, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """Tables for `records` and the names of what they leave out."""
    if len(records) == 1:  # one record reads better as a key/value table
        name, rec = records[0]
        flat = flatten(rec, MAX_LIST_IN_KV, f"{name}." if name is not None else "")
        rows = [[escape(k), text] for k, text in flat.cells.items()]
        notes = [_dropped_note(flat.dropped)] if flat.dropped else []
        return ([table(["Key", "Value"], rows)] if rows else []), notes
    shown = records[:MAX_ROWS]
    flats = [flatten(rec, MAX_LIST_IN_CELL) for _, rec in shown]
    columns: list[str] = []
    for f in flats:
        columns += [c for c in f.cells if c not in columns]
    numeric = {c: all(f.numeric.get(c, True) for f in flats) for c in columns}
    keyed = any(name is not None for name, _ in shown)
    # Columns that name a row (run, model, ...): leading text columns, repeated in each split.
    key_columns: list[str] = []
    if not keyed:
        for c in columns[:3]:
            if numeric[c]:
                break
            key_columns.append(c)
    value_columns = [c for c in columns if c not in key_columns]
    notes: list[str] = []
    dropped = list(dict.fromkeys(d for f in flats for d in f.dropped))
    if dropped:
        notes.append(_dropped_note(dropped))
    if len(records) > MAX_ROWS:
        notes.append(f"First {MAX_ROWS} of {len(records)} rows.")
    if not value_columns and not key_columns:
        return [], notes
    blocks = []
    for chunk in _chunks(value_columns) or [[]]:
        headers = ([""] if keyed else []) + [escape(c) for c in key_columns + chunk]
        right = [False] * (int(keyed) + len(key_columns)) + [numeric[c] for c in chunk]
        rows = []
        for (name, _), f in zip(shown, flats, strict=True):
            row = [escape(name)] if keyed and name is not None else ([""] if keyed else [])
            row += [f.cells.get(c, "–") for c in key_columns + chunk]
            rows.append(row)
        blocks.append(table(headers, rows, right))
    return blocks, notes


def _kv_table(items: dict[str, Any]) -> str:
    rows = []
    for key, value in items.items():
        # depth -1: the key itself is one more level than a record's columns
        flat = flatten({key: value}, MAX_LIST_IN_KV, depth=-1)
        rows += [[escape(k), text] for k, text in flat.cells.items()]
    return table(["Key", "Value"], rows)


def render_mapping(mapping: dict[str, Any], anchor: str, depth: int, title: str) -> list[str]:
    """Markdown blocks for a dict: key/value table, then one part per table-like child."""
    blocks: list[str] = []
    kv: dict[str, Any] = {}
    parts: list[tuple[str, Any]] = []
    omitted: list[str] = []
    for key, value in mapping.items():
        if depth == 0 and key == "command" and isinstance(value, str):
            blocks.append("```text\n" + value.strip() + "\n```")
        elif depth == 0 and isinstance(value, str) and (key in TEXT_KEYS or len(value) > LONG_TEXT):
            if value.strip():
                blocks.append(f"**{escape(key)}:** {prose(value)}")
        elif _records(value) is not None:
            parts.append((key, value))
        elif _fits_kv(value):
            kv[key] = value
        elif isinstance(value, dict) and depth < MAX_DEPTH:
            parts.append((key, value))
        else:
            omitted.append(key)
    if kv:
        blocks.append(_kv_table(kv))
    for key, value in parts:
        name = f"{title}.{key}" if title else key
        blocks += _render_part(name, value, f"{anchor}-{slug(str(key))}", depth + 1)
    if omitted:
        names = ", ".join(code(f"{title}.{k}" if title else k) for k in omitted)
        blocks.append(f"Not shown (nested too deep for this page; see the raw JSON): {names}.")
    return blocks


def _render_part(name: str, value: Any, anchor: str, depth: int) -> list[str]:
    heading = f"### {escape(name)} {{#{anchor}}}" if depth == 1 else f"**{escape(name)}**"
    records = _records(value)
    if records is not None:
        tables, notes = render_records(records)
        if tables:
            return [heading, *tables, *notes]
        if not isinstance(value, dict) or depth >= MAX_DEPTH:
            return [f"Not shown (nested too deep for this page; see the raw JSON): {code(name)}."]
    inner = render_mapping(value, anchor, depth, name)
    count = "\n".join(inner).count("\n| ---")
    if depth == 1 and count >= 2:
        # Several tables under one top-level key (per-repeat records): folded away, below
        # the tables that summarise them.
        text = "\n\n".join(inner)
        indented = "\n".join(("    " + line) if line else "" for line in text.splitlines())
        return [f'??? note "{escape(name)} ({count} tables)"\n\n{indented}']
    return [heading, *inner]


def render_result(stem: str, doc: Any, asset_base: str | None, has_png: bool) -> str:
    """The section for one result file (`doc` is its parsed JSON)."""
    anchor = slug(stem)
    out = [f"## {stem} {{#{anchor}}}"]
    if has_png and asset_base is not None:
        out.append(f"![{stem}]({asset_base}/{stem}.png)")
    if asset_base is not None:
        out.append(f"Raw data: [{stem}.json]({asset_base}/{stem}.json)")
    out += render_mapping(doc if isinstance(doc, dict) else {"data": doc}, anchor, 0, "")
    return "\n\n".join(out) + "\n"


def result_files(results_dir: Path) -> list[Path]:
    return sorted(results_dir.glob("*.json"))


def archive_files(results_dir: Path) -> list[Path]:
    return sorted((results_dir / ARCHIVE_DIR).glob("*.json"))


def result_assets(results_dir: Path) -> list[Path]:
    """Files the page links to: each JSON (archived ones included) and each PNG that has a
    JSON of the same stem."""
    out = []
    for path in [*result_files(results_dir), *archive_files(results_dir)]:
        out.append(path)
        png = path.with_suffix(".png")
        if png.exists():
            out.append(png)
    return out


def legend() -> str:
    return (
        "Each question has one current answer: one file of `benchmarks/results/` per question "
        "(the GPU's are in `benchmarks/results/gpu/`, with a README of their own), rendered "
        "from its JSON when the site is built. The table below gives each one's headline, its "
        "spread over repetitions, the machine (with the load average where the run recorded "
        "it), the date and the command that reproduces it; each section then shows the plot "
        "and folds the raw numbers below it. Superseded and exploratory runs are kept in "
        "`benchmarks/results/archive/`, linked at the end and never headlined. In the raw "
        "numbers, fractional numbers show 4 significant digits and a cell `m (lo – hi)` is a "
        f"median with the minimum and maximum over repeats; tables wider than {MAX_COLUMNS} "
        "columns are split."
    )


def _link(asset_base: str | None, rel: str) -> str:
    name = rel.rsplit("/", 1)[-1]
    return f"[{name}]({asset_base}/{rel})" if asset_base is not None else code(name)


def _fold(title: str, blocks: list[str]) -> str:
    text = "\n\n".join(blocks)
    indented = "\n".join(("    " + line) if line else "" for line in text.splitlines())
    return f'??? note "{title}"\n\n{indented}'


def summary_table(rows: list[tuple[questions.Question, dict[str, Any], Path]]) -> str:
    out = []
    for q, doc, path in rows:
        out.append(
            [
                f"[{prose(q.title)}](#{slug(q.stem)})",
                prose(q.headline(doc)),
                prose(q.spread(doc)),
                escape(questions.machine(doc)),
                escape(questions.date(doc, path)),
                code(questions.command(doc, q)),
            ]
        )
    return table(["question", "headline", "spread", "machine", "date", "command"], out)


def render_question(
    q: questions.Question, doc: dict[str, Any], results_dir: Path, asset_base: str | None
) -> str:
    """One question's section: plot, headline, command, files; the raw numbers folded."""
    path = results_dir / f"{q.stem}.json"
    out = [f"## {prose(q.title)} {{#{slug(q.stem)}}}"]
    if path.with_suffix(".png").exists() and asset_base is not None:
        out.append(f"![{q.stem}]({asset_base}/{q.stem}.png)")
    out.append(
        f"**{prose(q.headline(doc))}** (spread: {prose(q.spread(doc))}; "
        f"{escape(questions.machine(doc))}; {escape(questions.date(doc, path))})"
    )
    out.append("```text\n" + questions.command(doc, q) + "\n```")
    files = f"Result: {_link(asset_base, f'{q.stem}.json')}"
    if q.sources:
        files += ", computed from " + ", ".join(_link(asset_base, f"{s}.json") for s in q.sources)
    older = [a for a, of in questions.ARCHIVE.items() if of == q.stem]
    older = [a for a in older if (results_dir / ARCHIVE_DIR / f"{a}.json").exists()]
    if older:
        links = ", ".join(_link(asset_base, f"{ARCHIVE_DIR}/{a}.json") for a in older)
        files += f"; earlier or exploratory runs (archive): {links}"
    out.append(files + ".")
    raw = render_mapping(doc if isinstance(doc, dict) else {"data": doc}, slug(q.stem), 0, "")
    out.append(_fold(f"Raw numbers: {q.stem}.json", raw))
    return "\n\n".join(out) + "\n"


def _archive_note(doc: Any) -> str:
    if not isinstance(doc, dict):
        return ""
    for key in ("note", "title", "question", "what"):
        text = doc.get(key)
        if isinstance(text, str) and text.strip():
            text = " ".join(text.split())
            return text if len(text) <= 200 else text[:199] + "…"
    return ""


def render_archive(results_dir: Path, asset_base: str | None) -> str:
    rows = []
    for path in archive_files(results_dir):
        of = questions.ARCHIVE.get(path.stem)
        doc = json.loads(path.read_text(encoding="utf-8"))
        rows.append(
            [
                _link(asset_base, f"{ARCHIVE_DIR}/{path.name}"),
                f"[{slug(of)}](#{slug(of)})" if of else "–",
                prose(_archive_note(doc)),
            ]
        )
    intro = (
        "Superseded and exploratory runs, kept for the record (guides may cite them); the "
        "sections above give the current answers."
    )
    return "\n\n".join(["## Archive {#archive}", intro, table(["file", "run of", "note"], rows)])


def render_benchmarks(results_dir: Path, asset_base: str | None = None) -> str:
    """The whole generated part of the benchmarks page. `asset_base` is the link from the
    page to the folder where the site holds the JSON and PNG files (None: no links).

    The questions of `questions.QUESTIONS` whose file is present come first, as a table and
    a section each; a result file no question names gets a plain section after them."""
    parts = [legend(), ""]
    rows = []
    for q in questions.QUESTIONS:
        path = results_dir / f"{q.stem}.json"
        if path.exists():
            rows.append((q, json.loads(path.read_text(encoding="utf-8")), path))
    if rows:
        parts += [summary_table(rows), ""]
        parts += [render_question(q, doc, results_dir, asset_base) for q, doc, _ in rows]
    named = {q.stem for q in questions.QUESTIONS} | {
        s for q in questions.QUESTIONS for s in q.sources
    }
    for path in result_files(results_dir):
        if path.stem in named:
            continue
        doc = json.loads(path.read_text(encoding="utf-8"))
        has_png = path.with_suffix(".png").exists()
        parts.append(render_result(path.stem, doc, asset_base, has_png))
    if archive_files(results_dir):
        parts.append(render_archive(results_dir, asset_base))
    return "\n".join(parts)
