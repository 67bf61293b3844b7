"""Where ``um.to_module()`` and ``calibrator.to_module()`` find the exporter: registered by :mod:`posthoc.export`.

The exporter reads every method's fitted state, so it sits above the methods; the engine's ``UncertainModel`` and a
calibrator call it through this registry (as ``wrap`` finds a method through :mod:`posthoc.core.registry`) instead of
importing upwards. ``import posthoc`` registers it.

Example:
    >>> from posthoc.core.exporters import EXPORTERS
    >>> sorted(EXPORTERS)
    ['calibrator', 'model']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posthoc.errors import ExportError

#: exporter by what it exports: ``"model"`` (an ``UncertainModel``) and ``"calibrator"``
EXPORTERS: dict[str, Callable[..., Any]] = {}


def register_exporter(kind: str, function: Callable[..., Any]) -> None:
    """Make ``function`` the exporter of ``kind`` (``"model"`` or ``"calibrator"``)."""
    EXPORTERS[kind] = function


def exporter(kind: str) -> Callable[..., Any]:
    """The exporter of ``kind``; refused with a clear error when ``posthoc.export`` was never imported."""
    if kind not in EXPORTERS:
        raise ExportError(f"no exporter of {kind}s is registered: import posthoc (which imports posthoc.export) first")
    return EXPORTERS[kind]
