"""Markdown as a notebook shows it: the HTML of the small Markdown that posthoc writes (headings, paragraphs, lists,
pipe tables, ``**bold**`` and backquoted code), for the ``_repr_html_`` of reports and model cards.

Example:
    >>> from posthoc.core.rendering import markdown_html
    >>> markdown_html("# Card\\n\\n| a | b |\\n|---|---|\\n| **1** | `x` |")
    '<h3>Card</h3>\\n<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td><b>1</b></td><td><code>x</code></td></tr></tbody></table>'
"""

from __future__ import annotations

import html
import re

#: a notebook's headings are large: ``#`` renders as ``<h3>``, ``##`` as ``<h4>`` ...
HEADING_SHIFT = 2


def inline_html(text: str) -> str:
    """Escaped ``text`` with ``**bold**`` and backquoted code."""
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def _table(rows: list[str]) -> str:
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
    body = [row for row in cells[1:] if not all(set(cell) <= set("-: ") for cell in row)]
    head = "".join(f"<th>{inline_html(cell)}</th>" for cell in cells[0])
    lines = "".join("<tr>" + "".join(f"<td>{inline_html(cell)}</td>" for cell in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def markdown_html(text: str) -> str:
    """The HTML of ``text`` (see module docs), one block a line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            blocks.append(_table(lines[start:i]))
            continue
        if line.startswith("- "):
            start = i
            while i < len(lines) and lines[i].startswith("- "):
                i += 1
            blocks.append("<ul>" + "".join(f"<li>{inline_html(item[2:])}</li>" for item in lines[start:i]) + "</ul>")
            continue
        heading = re.match(r"(#{1,6}) (.*)", line)
        if heading:
            level = min(6, len(heading.group(1)) + HEADING_SHIFT)
            blocks.append(f"<h{level}>{inline_html(heading.group(2))}</h{level}>")
        elif line.strip():
            blocks.append(f"<p>{inline_html(line)}</p>")
        i += 1
    return "\n".join(blocks)
