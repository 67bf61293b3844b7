"""A method's options as a dataclass: :class:`Options`, the base every method's ``Options`` and ``FitOptions`` extend.

A method lists what ``wrap`` takes for it (and what ``fit`` takes) as the fields of a frozen, keyword-only dataclass,
each with its type and default; ``wrap``, the CLI and the docs read those fields (:meth:`Options.defaults`), never a
signature. The method reads ``options.num_samples`` in its ``__init__`` and checks the values there, with its own
messages.

A calibrator, an OOD score or a likelihood declares its ``Options`` the same way, and its ``__init__`` takes the same
fields as keyword arguments (``posthoc.Gaussian(noise_std=0.5)``, ``Energy(temperature=2.0)``):
:func:`build` makes one from a dict of values, refusing unknown names, and ``tests/methods/test_registry_contract.py``
checks that the fields and the keywords agree.

Example:
    >>> from posthoc.core.options import Options
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True, kw_only=True)
    ... class DropoutOptions(Options):
    ...     p: float = 0.1
    ...     num_samples: int = 50
    >>> DropoutOptions.defaults()
    {'p': 0.1, 'num_samples': 50}
    >>> DropoutOptions.make({"p": 0.2}, "'mc-dropout'").as_dict()
    {'p': 0.2, 'num_samples': 50}
    >>> DropoutOptions.make({"rate": 0.2}, "'mc-dropout'")
    Traceback (most recent call last):
    posthoc.errors.ConfigError: unknown option(s) ['rate'] for 'mc-dropout'; valid options: p=0.1, num_samples=50
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from posthoc.core.checks import known_options

OptionsT = TypeVar("OptionsT", bound="Options")
BuiltT = TypeVar("BuiltT")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """The options of a method (or of its ``fit``): subclass it as a ``@dataclass(frozen=True, kw_only=True)`` whose
    fields are the options, each with its type and default. This base has none."""

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's name and default, in declaration order."""
        return {
            field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
            for field in dataclasses.fields(cls)
        }

    @classmethod
    def make(cls: type[OptionsT], values: dict[str, Any], owner: str) -> OptionsT:
        """The options of ``values`` (the rest at their defaults); a name that is not an option fails with
        :class:`~posthoc.errors.ConfigError`, listing ``owner``'s valid ones with their defaults."""
        return cls(**known_options(values, cls.defaults(), owner))

    def as_dict(self) -> dict[str, Any]:
        """The options by name (values as given: not copied)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def build(cls: type[BuiltT], values: dict[str, Any], owner: str) -> BuiltT:
    """A ``cls`` (a calibrator, an OOD score or a likelihood: its ``__init__`` keywords are the fields of its
    ``Options``) of ``values``, the rest at their defaults; an unknown name fails as in :meth:`Options.make`.

    Example:
        >>> from posthoc.core.options import build
        >>> from posthoc.core.likelihood import Gaussian
        >>> float(build(Gaussian, {"noise_std": 0.5}, "likelihood 'regression'").noise_std)
        0.5
        >>> build(Gaussian, {"scale": 2}, "likelihood 'regression'")
        Traceback (most recent call last):
        posthoc.errors.ConfigError: unknown option(s) ['scale'] for likelihood 'regression'; valid options: noise_std=None
    """
    return cls(**cls.Options.make(values, owner).as_dict())  # type: ignore[attr-defined]
