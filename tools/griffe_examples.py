"""A griffe extension for the docs site: read a docstring's ``Example:`` section as Google style's ``Examples:``.

posthoc's docstrings title their doctests ``Example:``, which Google style (as griffe parses it) takes for an
admonition whose body is Markdown, where ``>>>`` would become nested block quotes. Renaming the section while the
docs are built renders them as code, without touching the docstrings that ``--doctest-modules`` runs.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExamplesSection(griffe.Extension):
    """Rename ``Example:`` section titles to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
