"""A griffe extension for the docs site: read posthoc's docstrings as the Google style the site renders.

Applied to every docstring while the docs are built (the docstrings themselves, which ``--doctest-modules`` runs,
are left as they are):

- an ``Example:`` section becomes Google style's ``Examples:``, rendered as code (as an admonition its ``>>>``
  lines would be Markdown block quotes);
- an ``Options:`` section (a method's options, its keyword-only ``__init__`` arguments) becomes ``Other
  Parameters:``, rendered as a table of names and descriptions;
- Sphinx roles (``:class:`~posthoc.x.Y```, ``:func:`f```, ...) become code spans (``Y``, ``f``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_OPTIONS = re.compile(r"^(\s*)Options:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with the rewrites of the module docs."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _OPTIONS.sub(r"\1Other Parameters:", text)
    return _ROLE.sub(_role, text)


class ExamplesSection(griffe.Extension):
    """Rewrite every docstring griffe loads with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
