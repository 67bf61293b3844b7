"""Self-contained HTML from the reports' Markdown: tables, headings, lists, and PNGs embedded as data URIs.

Only the Markdown that posthoc writes is understood (``#`` headings, pipe tables, ``- `` lists, ``**bold**``,
``![alt](file.png)`` images, paragraphs); every image is read from disk and embedded, so the one HTML file
can be mailed or attached to an issue.

A report's page (:func:`write_html`) holds its tables and its figures; given reports of other methods on the same
test set, the verdict and its frontier first. :func:`html_view` is the same without the page around it.

Example:
    >>> from posthoc_apps.report.page import write_html, write_markdown_page
    >>> from posthoc_apps.demo.examples import report, plain_report
    >>> path = write_markdown_page(report.to_markdown(), "report.html", title="posthoc demo")
    >>> path, "<table>" in path.read_text()
    (PosixPath('report.html'), True)
    >>> write_html(plain_report, "compared.html", report)     # the plain model first, then the others
    PosixPath('compared.html')
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from posthoc.core.paths import as_path, output_file
from posthoc.evaluation.gaussian_report import ENCE_BINS
from posthoc.evaluation.report import Compared, Report, operating_points
from posthoc.evaluation.verdict import FRONTIER_FILE
from posthoc_apps.report import figures, plots
from posthoc_apps.report.plots import png_bytes

STYLE = """
*, *::before, *::after { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
p, li, h1, h2, h3, h4, h5, h6 { overflow-wrap: anywhere; }
.wide { max-width: 100%; overflow-x: auto; margin: 0.8em 0; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.4em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; white-space: normal; } td:first-child, th:first-child { text-align: left; }
td:first-child { white-space: normal; min-width: 9em; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; height: auto; margin: 0.5em 0; }
code { background: #eee; padding: 0 0.2em; border-radius: 2px; }
.verdict { background: #f4f8f4; border-left: 4px solid #2ca02c; padding: 0.1em 1em; }
.side { display: flex; flex-wrap: wrap; gap: 0 2em; align-items: flex-start; }
.side > * { min-width: 0; max-width: 100%; }
.ci { color: #666; font-size: 0.85em; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #444; max-width: 60em; }
"""
#: the class of the container every table sits in: it scrolls sideways itself, so a wide table never widens the page
WIDE = "wide"
#: the heading (level 2) of the section that opens a report comparing methods
VERDICT = "Verdict"
#: the class of the container that sets the verdict's table and its frontier side by side (stacked when narrow)
SIDE = "side"
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)]+)\)")
#: a table cell holding a value and its interval, ``0.0809 [0.0470, 0.1204]``: the interval goes under the value
_WITH_INTERVAL = re.compile(r"^(.*\S) (\[[^\]]+\]†?)$")


def image_tag(png: bytes, alt: str = "") -> str:
    """An ``<img>`` holding ``png`` as a base64 data URI."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def figure_tag(fig: Figure, alt: str = "") -> str:
    """An ``<img>`` of a matplotlib figure, embedded."""
    return image_tag(png_bytes(fig), alt)


def _text(text: str) -> str:
    """Escaped text with ``**bold**`` and backquoted code."""
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


@dataclass(frozen=True)
class _Images:
    """Where a page's images come from: PNG bytes given by name, else files relative to ``base_dir``."""

    base_dir: Path | None = None
    given: Mapping[str, bytes] = field(default_factory=dict)

    def png(self, name: str) -> bytes | None:
        if name in self.given:
            return self.given[name]
        path = Path(name) if self.base_dir is None else self.base_dir / name
        return path.read_bytes() if path.is_file() else None


def _inline(text: str, images: _Images) -> str:
    """Escaped text with ``**bold**``, and each ``![alt](file.png)`` embedded (left as text if the file is missing)."""
    out, last = [], 0
    for match in _IMAGE.finditer(text):
        png = images.png(match.group(2))
        out.append(_text(text[last : match.start()]))
        out.append(html.escape(match.group(0)) if png is None else image_tag(png, match.group(1)))
        last = match.end()
    out.append(_text(text[last:]))
    return "".join(out)


def _cell(text: str, images: _Images) -> str:
    """A table cell's HTML: a value with its interval puts the interval on a line of its own, in grey, so that a
    table of intervals is half as wide."""
    found = _WITH_INTERVAL.match(text)
    if found is None:
        return _inline(text, images)
    return f'{_inline(found.group(1), images)}<br><span class="ci">{html.escape(found.group(2))}</span>'


def _table(rows: list[str], images: _Images) -> str:
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    body = [r for r in cells[1:] if not all(set(c) <= set("-: ") for c in r)]
    head = "".join(f"<th>{_inline(c, images)}</th>" for c in cells[0])
    lines = "".join("<tr>" + "".join(f"<td>{_cell(c, images)}</td>" for c in r) + "</tr>" for r in body)
    return f'<div class="{WIDE}"><table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table></div>'


def markdown_to_html(
    text: str, base_dir: str | os.PathLike | None = None, *, images: Mapping[str, bytes] | None = None
) -> str:
    """The HTML body of posthoc's Markdown; images are read relative to ``base_dir`` (or, by name, from ``images``:
    PNG bytes drawn in memory) and embedded.

    Example:
        >>> from posthoc_apps.report.page import markdown_to_html
        >>> markdown_to_html("| a | b |\\n|---|---|\\n| 1 | 2 |")
        '<div class="wide"><table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>2</td></tr></tbody></table></div>'

    A ``## Verdict`` section (up to the next heading) sits in a ``<section class="verdict">``; in it a table followed
    by an image (the verdict's numbers and its frontier) sit side by side in a ``<div class="side">``.
    """
    return _blocks(text, _Images(None if base_dir is None else Path(base_dir), dict(images or {})))


def _blocks(text: str, base: _Images) -> str:
    """The HTML blocks of ``text`` (see :func:`markdown_to_html`)."""
    blocks, lines = [], text.splitlines()
    i, in_verdict = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            table = _table(lines[start:i], base)
            after = next((j for j in range(i, len(lines)) if lines[j].strip()), None)
            if in_verdict and after is not None and _IMAGE.fullmatch(lines[after].strip()):
                image = _inline(lines[after].strip(), base)
                blocks.append(f'<div class="{SIDE}">{table}<div>{image}</div></div>')
                i = after + 1
            else:
                blocks.append(table)
            continue
        if line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:], base)}</li>")
                i += 1
            blocks.append("<ul>" + "".join(items) + "</ul>")
            continue
        heading = re.match(r"(#{1,6}) (.*)", line)
        if heading:
            level = len(heading.group(1))
            if in_verdict:
                blocks.append("</section>")
                in_verdict = False
            if level == 2 and heading.group(2).strip() == VERDICT:
                blocks.append('<section class="verdict">')
                in_verdict = True
            blocks.append(f"<h{level}>{_inline(heading.group(2), base)}</h{level}>")
        elif line.strip():
            blocks.append(f"<p>{_inline(line, base)}</p>")
        i += 1
    return "\n".join(blocks + (["</section>"] if in_verdict else []))


def figure_block(fig: Figure, alt: str, caption: str) -> str:
    """A ``<figure>`` of a matplotlib figure, embedded, with its caption.

    Example:
        >>> from posthoc_apps.report.page import figure_block
        >>> from matplotlib.figure import Figure
        >>> figure_block(Figure(), "empty", "An empty figure.").endswith("<figcaption>An empty figure.</figcaption></figure>")
        True
    """
    return f"<figure>{figure_tag(fig, alt)}<figcaption>{_text(caption)}</figcaption></figure>"


def page(body: str, title: str) -> str:
    """A complete HTML document around ``body``."""
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def write_page(path: str | os.PathLike, body: str, title: str) -> Path:
    """Write :func:`page` of the HTML ``body`` to ``path``; returns the path.

    Example:
        >>> from posthoc_apps.report.page import write_page
        >>> from posthoc_apps.demo.examples import report
        >>> from posthoc_apps.report.page import html_view
        >>> write_page("out/report.html", html_view(report), "posthoc report")
        PosixPath('out/report.html')
    """
    with output_file(path, "the report") as target:
        target.write_text(page(body, title), encoding="utf-8")
    return target


def write_markdown_page(markdown: str, path: str | os.PathLike, *, title: str = "posthoc report") -> Path:
    """Write ``markdown`` as one self-contained HTML file (its images, relative to ``path``'s folder, embedded).

    Example:
        >>> from posthoc_apps.report.page import write_markdown_page
        >>> write_markdown_page("# Report\\n\\n![rc](risk_coverage.png)", "out/report.html")
        PosixPath('out/report.html')
    """
    return write_page(path, markdown_to_html(markdown, as_path(path).parent), title)


def html_view(report: Report) -> str:
    """One report as HTML: its metrics (and OOD) tables and its figures (a classifier's reliability diagram,
    risk-coverage curve and OOD histograms; a regressor's calibration curve and error against the predicted std)."""
    tables = markdown_to_html(report._repr_markdown_())
    if report.kind == "gaussian":
        drawn = [
            figure_tag(figures.calibration_curve(report), "calibration curve"),
            figure_tag(figures.error_against_std(report), "error against predicted std"),
        ]
    else:
        drawn = [
            figure_tag(figures.reliability_diagram(report), "reliability diagram"),
            figure_tag(figures.risk_coverage_curve(report), "risk-coverage curve"),
        ]
        if report.ood_values:
            drawn.append(figure_tag(figures.ood_histograms(report), "OOD score histograms"))
    return tables + "\n" + "\n".join(drawn)


def write_html(
    report: Report,
    path: str | os.PathLike,
    *others: Report,
    shifts: Mapping[str, Sequence[Report]] | None = None,
) -> Path:
    """Write ``report`` as one self-contained HTML page (figures embedded, :func:`html_view`); returns the path.

    Given ``others`` (and ``shifts``, as in :meth:`~posthoc.evaluation.report.Report.to_markdown`), ``report`` is the
    plain model: a title, the verdict with its table and (with shifts) its frontier side by side, then the table of
    every report, and the reliability diagrams and risk-coverage curves (a regressor's: calibration curves and error
    against the predicted std) of the plain model, the recommended report and the few best, each with its caption.
    """
    if not others:
        return write_page(path, html_view(report), f"posthoc report: {report.name}")
    compared = Compared.of([report, *others], shifts)
    found, reports = compared.verdict, compared.reports
    title = f"posthoc report: {len(reports)} methods on one test set, against the plain model `{report.name}`"
    images, frontier = {}, None
    if found.shifts:
        frontier = FRONTIER_FILE
        images[frontier] = png_bytes(
            plots.frontier(found.frontier_points(), tolerance=found.tolerance, title="test data")
        )
    drawn = [r for r in reports if r.name in set(found.featured())]
    who = ", ".join(f"`{r.name}`" for r in drawn) + " (the plain model, the recommended one and the few best)"
    body = [
        f"<h1>{html.escape(title)}</h1>",
        markdown_to_html(found.markdown(frontier), images=images),
        markdown_to_html(compared.table()),
        *(figure_block(*picture) for picture in _compared_pictures(drawn, who)),
    ]
    return write_page(path, "\n".join(body), title)


def _compared_pictures(drawn: Sequence[Report], who: str) -> list[tuple[Figure, str, str]]:
    """The figures of the reports a compared page draws, as ``(figure, alt, caption)``, by the reports' kind."""
    if drawn[0].kind == "gaussian":
        predictives = {r.name: (r.means, r.stds, r.targets) for r in drawn}
        bins = min(ENCE_BINS, drawn[0].targets.numel())
        return [
            (plots.calibration_curves(predictives), "calibration curves", f"Calibration curves of {who}."),
            (
                plots.error_against_std(predictives, bins=bins),
                "error against predicted std",
                f"RMSE against std, {who}.",
            ),
        ]
    curves = {r.name: (r.probs, r.labels) for r in drawn}
    return [
        (
            plots.reliability_diagram(curves),
            "reliability diagrams",
            f"Reliability diagrams of {who}: accuracy against confidence per bin, the count of each bin under it.",
        ),
        (
            plots.risk_coverage_curve(curves, None, operating_points(*drawn)),
            "risk-coverage curves",
            f"Risk against coverage of {who}: the error rate of the most confident examples kept.",
        ),
    ]
