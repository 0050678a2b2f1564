"""Markdown pieces shared by the page generators: escaped text, code spans, tables, anchors."""

from __future__ import annotations

import re
from collections.abc import Sequence

# Characters Python-Markdown would read as markup in running text (emphasis, links, tables).
_SPECIAL = re.compile(r"([\\*_\[\]|])")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_SPACE = re.compile(r"\s+")


def escape(text: str) -> str:
    """Plain text -> Markdown that shows exactly that text (one line: newlines become spaces)."""
    text = _SPACE.sub(" ", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _SPECIAL.sub(r"\\\1", text)


def prose(text: str) -> str:
    """Help or docstring text -> one line of Markdown.

    Backtick code spans are kept as code; everything else is escaped, so `<config>` or `H*W`
    in a help text shows as written instead of becoming an HTML tag or emphasis.
    """
    text = _SPACE.sub(" ", text).strip()
    out: list[str] = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        out.append(escape(text[pos : m.start()]))
        out.append(code(m.group(2)))
        pos = m.end()
    out.append(escape(text[pos:]))
    return "".join(out)


def code(text: str) -> str:
    """A code span holding `text` as written (backticks inside are fenced by longer runs)."""
    text = " ".join(str(text).split())
    fence = "`"
    while fence in text:
        fence += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def slug(text: str) -> str:
    """An HTML id made of lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()) -> str:
    """A Markdown table; cells are Markdown already (escape them first). `right[i]` aligns
    column i to the right (numbers)."""
    align = [("---:" if i < len(right) and right[i] else "---") for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        cells = [c.replace("\n", " ") for c in row]
        cells += [""] * (len(headers) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
