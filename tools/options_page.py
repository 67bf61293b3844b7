"""Write ``docs/options.md``: every registered method's and calibrator's options, read from their dataclasses.

Each row is one field of a method's ``Options`` (what ``wrap`` takes) or ``FitOptions`` (what ``fit`` takes): its
name, its type (a ``Literal``'s choices spelled out), its default and its one-line help (the field's
``metadata["help"]``, :func:`posthoc.core.options.option`). The options are declared in their dataclass only; this
page is generated from it, and ``tests/test_options_page.py`` fails when the page is stale.

Run ``python tools/options_page.py`` (``--check`` exits 1 when ``docs/options.md`` differs).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import posthoc  # noqa: F401  # registers every method
from posthoc.core.registry import method_class, method_names

PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"

HEADER = """# Options reference

Every option of every registered method and calibrator: what ``posthoc.wrap(model, method=..., **options)`` takes
(*wrap*), and what ``um.fit(..., **options)`` takes (*fit*). Generated from the methods' ``Options`` and
``FitOptions`` dataclasses by ``python tools/options_page.py``; do not edit by hand.
"""


def type_name(hint: Any) -> str:
    """``hint`` as the page shows it: ``Literal["a", "b"]`` as ``'a' | 'b'``, unions joined by ``|``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(member) for member in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is not None:
        args = ", ".join("..." if arg is Ellipsis else type_name(arg) for arg in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def rows(options: type, where: str) -> list[str]:
    """The table rows of the fields of ``options`` (an ``Options`` dataclass)."""
    hints = typing.get_type_hints(options)
    found = []
    for field in dataclasses.fields(options):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kind = type_name(hints[field.name]).replace("|", "\\|")
        help_text = field.metadata.get("help", "")
        found.append(f"| `{field.name}` | {where} | `{kind}` | `{default!r}` | {help_text} |")
    return found


def page() -> str:
    """The whole page, one section per registered name."""
    parts = [HEADER]
    for name in method_names():
        cls = method_class(name)
        table = rows(cls.Options, "wrap") + rows(cls.FitOptions, "fit")
        parts.append(f"## `{name}`\n")
        if table:
            parts.append("| option | of | type | default | help |\n|---|---|---|---|---|\n" + "\n".join(table) + "\n")
        else:
            parts.append("No options.\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = page()
    if "--check" in argv:
        return 0 if PAGE.exists() and PAGE.read_text() == text else 1
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
