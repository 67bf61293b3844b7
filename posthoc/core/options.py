"""A method's options as a dataclass: :class:`Options`, the base every method's ``Options`` and ``FitOptions`` extend.

A method lists what ``wrap`` (and ``fit``) takes as the fields of a frozen, keyword-only dataclass, each with its
type, default and one-line help (:func:`option`); ``wrap``, the CLI and ``docs/options.md`` (written by
``tools/options_page.py``) read those fields, never a signature. A ``Literal[...]`` field is checked when the options
are made; a subclass adds its own checks in ``__post_init__``. A calibrator, an OOD score or a likelihood declares its
``Options`` the same way, with the same fields as ``__init__`` keywords (:func:`build`).

Example:
    >>> from dataclasses import dataclass
    >>> from typing import Literal
    >>> from posthoc.core.options import Options
    >>> @dataclass(frozen=True, kw_only=True)
    ... class DropoutOptions(Options):
    ...     p: float = 0.1
    ...     masks: Literal["shared", "per_example"] = "per_example"
    >>> DropoutOptions.make({"p": 0.2}, "'mc-dropout'").as_dict()
    {'p': 0.2, 'masks': 'per_example'}
    >>> DropoutOptions(masks="each")
    Traceback (most recent call last):
    posthoc.errors.ConfigError: masks must be one of ('shared', 'per_example'), got 'each'
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar

from posthoc.core.checks import known_options, one_of

OptionsT = TypeVar("OptionsT", bound="Options")
BuiltT = TypeVar("BuiltT")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """The options of a method (or of its ``fit``), as a ``@dataclass(frozen=True, kw_only=True)`` subclass."""

    def __post_init__(self) -> None:
        """Refuse a value outside a ``Literal`` field's choices (a string, where the field takes other types too)."""
        for name, (choices, only) in literal_fields(type(self)).items():
            value = getattr(self, name)
            if only or isinstance(value, str):
                one_of(value, name, choices)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's name and default, in declaration order."""
        return {
            field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
            for field in dataclasses.fields(cls)
        }

    @classmethod
    def make(cls: type[OptionsT], values: dict[str, Any], owner: str) -> OptionsT:
        """The options of ``values`` (the rest at their defaults), refusing unknown names (listing ``owner``'s)."""
        return cls(**known_options(values, cls.defaults(), owner))

    def as_dict(self) -> dict[str, Any]:
        """The options by name (values as given: not copied)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def option(default: Any, help: str) -> Any:  # noqa: A002  # (the name of the metadata key)
    """A field with ``default`` and a one-line ``help`` (its metadata), which ``docs/options.md`` shows.

    Example:
        >>> import dataclasses
        >>> from posthoc.core.options import Options, option
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Sampled(Options):
        ...     num_samples: int = option(20, "draws of the posterior per prediction")
        >>> dataclasses.fields(Sampled)[0].metadata["help"]
        'draws of the posterior per prediction'
    """
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@functools.cache
def literal_fields(cls: type) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """``name -> (choices, only)`` of the ``Literal`` fields of ``cls``: its choices (with ``None`` where allowed), and
    whether they are all the field takes (else only a string must be one of them).

    Example:
        >>> import dataclasses
        >>> from typing import Literal
        >>> from posthoc.core.options import Options, literal_fields
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Prior(Options):
        ...     prior_precision: Literal["auto", "val"] | float = "auto"
        >>> literal_fields(Prior)
        {'prior_precision': (('auto', 'val'), False)}
    """
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        literals = [m for m in members if typing.get_origin(m) is Literal]
        if not literals:
            continue
        others = [m for m in members if typing.get_origin(m) is not Literal and m is not type(None)]
        choices = tuple(choice for literal in literals for choice in typing.get_args(literal))
        if type(None) in members:
            choices = (*choices, None)
        found[field.name] = (choices, not others)
    return found


def build(cls: type[BuiltT], values: dict[str, Any], owner: str) -> BuiltT:
    """A ``cls`` (whose ``__init__`` keywords are the fields of its ``Options``) of ``values``, the rest at their
    defaults; an unknown name fails as in :meth:`Options.make`.

    Example:
        >>> from posthoc.core.options import build
        >>> from posthoc.core.likelihood import Gaussian
        >>> build(Gaussian, {"scale": 2}, "likelihood 'regression'")
        Traceback (most recent call last):
        posthoc.errors.ConfigError: unknown option(s) ['scale'] for likelihood 'regression'; valid options: noise_std=None
    """
    return cls(**cls.Options.make(values, owner).as_dict())  # type: ignore[attr-defined]
