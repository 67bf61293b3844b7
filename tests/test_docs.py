"""The README is a front page and the docs site holds the rest: lengths, links, code blocks, and the strict build.

The README must stay short (what it is, the two commands, one example, a table of what is inside, links into
``docs/``), every relative link in it and in ``docs/`` must point at a file (and heading) that exists, since they
are read on GitHub as well as on the site, and ``mkdocs build --strict`` must pass (run here when mkdocs is
installed: the ``test`` extra brings it through ``posthoc[docs]``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
#: the README's ceiling (issue 36): everything longer belongs in docs/
MAX_README_LINES = 250

FENCE = re.compile(r"^```(\w*)\s*$")
#: the line right before a ```python fence that marks the block as runnable (docs/development.md): an HTML comment,
#: which Markdown, GitHub and mkdocs all leave unrendered and which changes nothing in the fence itself
RUNNABLE = "<!-- runnable -->"
#: Markdown inline links ``[text](target)``, not images of remote badges; the target up to a space or ``)``
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link-like string in code is not a link)."""
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``text``, in order."""
    blocks, current, inside = [], [], None
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if match and inside is None:
            inside, current = match.group(1), []
        elif match and not match.group(1) and inside is not None:
            if inside == language:
                blocks.append("\n".join(current))
            inside = None
        elif inside is not None:
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs' ``toc`` both give a heading: lower case, code marks and punctuation dropped,
    spaces to hyphens (the headings here keep to what both spell alike)."""
    text = re.sub(r"`|\*\*|\\\(|\\\)", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"\s", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(m.group(2)) for line in prose(page.read_text()).splitlines() if (m := HEADING.match(line))}


def relative_links(page: Path) -> list[str]:
    return [
        t
        for t in LINK.findall(prose(page.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("//")
    ]


def test_readme_is_a_front_page_with_the_two_commands_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move the detail into docs/"
    # .ci/run reads the test command from the second line of the first code block
    assert lines[0] == "```bash" and "posthoc demo" in lines[1] and "python -m pytest" in lines[2], lines[:3]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A heading\n\nSee [there](missing.md), [here](#a-heading), [gone](#nowhere) and "
        "[web](https://example.org).\n\n```python\nx = [1](2)\n```\n"
    )
    assert relative_links(page) == ["missing.md", "#a-heading", "#nowhere"]
    assert anchors(page) == {"a-heading"}
    assert (
        slug("3. From the command line: `posthoc evaluate` and `posthoc demo`")
        == "3-from-the-command-line-posthoc-evaluate-and-posthoc-demo"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse_and_their_posthoc_imports_exist(page: Path) -> None:
    """Every ```python block is valid Python, and what it imports from posthoc is there (the examples use the
    reader's own ``model`` and loaders, so they are not run here; the doctests run the library's own)."""
    for block in code_blocks(page.read_text(), "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "posthoc":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"{page.name}: from {node.module} import {alias.name}"
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "posthoc":
                        importlib.import_module(alias.name)


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of ``text`` marked :data:`RUNNABLE` (the marker on the line before the fence, blank
    lines between allowed), each with the line its code starts on, in order."""
    lines = text.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == RUNNABLE:
            fence = index + 1
            while fence < len(lines) and not lines[fence].strip():
                fence += 1
            assert fence < len(lines) and lines[fence].strip() == "```python", (
                f"line {index + 1}: {RUNNABLE} must come right before a ```python fence"
            )
            end = fence + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            blocks.append((fence + 2, "\n".join(lines[fence + 1 : end])))
            index = end
        index += 1
    return blocks


RUNNABLE_PAGES = [page for page in sorted(DOCS.rglob("*.md")) if RUNNABLE in page.read_text()]


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_runnable_block_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block marked runnable runs as printed, the blocks of a page in order in one namespace (as a
    reader pastes them into one notebook), in a fresh folder (what they write stays there), so a page cannot say
    what the code no longer does."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, block in runnable_blocks(page.read_text()):
        code = compile("\n" * (line - 1) + block, str(page.relative_to(ROOT)), "exec")
        exec(code, namespace)  # noqa: S102  (the docs' own examples)


def test_the_runnable_marker_is_found_and_a_failing_block_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```python\nnot run\n```\n\n<!-- runnable -->\n```python\nx = 1\n```\n\n<!-- runnable -->\n\n"
        "```python\nassert x == 2, 'stale'\n```\n"
    )
    blocks = runnable_blocks(page.read_text())
    assert blocks == [(9, "x = 1"), (15, "assert x == 2, 'stale'")]
    namespace: dict = {}
    exec(blocks[0][1], namespace)  # noqa: S102
    with pytest.raises(AssertionError, match="stale"):
        exec(blocks[1][1], namespace)  # noqa: S102
    with pytest.raises(AssertionError, match="right before"):
        runnable_blocks("<!-- runnable -->\ntext\n")


NEEDED = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


@pytest.mark.skipif(
    any(importlib.util.find_spec(name.split(".")[0]) is None for name in NEEDED),
    reason="mkdocs, mkdocs-material or mkdocstrings[python] is not installed (pip install -e '.[docs]')",
)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(ROOT / "mkdocs.yml"),
        "--site-dir",
        str(tmp_path / "site"),
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, check=False, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "entry-points" / "index.html").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("griffe") is None, reason="griffe (from mkdocstrings[python]) is not installed"
)
def test_the_site_reads_examples_options_and_roles_as_google_style() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from griffe_examples import markdown_docstring
    finally:
        sys.path.remove(str(ROOT / "tools"))
    text = (
        "Built by :meth:`algorithm`, see :mod:`~posthoc.engine.selection`.\n\nOptions:\n    p: a rate.\n\n"
        "Example:\n    >>> 1 + 1\n    2\n"
    )
    assert markdown_docstring(text) == (
        "Built by `algorithm`, see `selection`.\n\n"
        "Other Parameters:\n    p: a rate.\n\nExamples:\n    >>> 1 + 1\n    2\n"
    )
    assert markdown_docstring("Fit options: ``epochs``.") == "Fit options: ``epochs``."  # prose stays prose
