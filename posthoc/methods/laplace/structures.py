"""The key map from ``hessian=`` to the :class:`~posthoc.methods.laplace.structure.Curvature` class that holds it.

``"kron-mc"`` is fitted differently (BackPACK's sampled KFAC) but held as ``"kron"``.

Example:
    >>> from posthoc.methods.laplace.structures import structure_class
    >>> structure_class("kron-mc").__name__
    'KronCurvature'
"""

from __future__ import annotations

from posthoc.methods.laplace.diag import DiagCurvature
from posthoc.methods.laplace.full import FullCurvature
from posthoc.methods.laplace.kron import KronCurvature
from posthoc.methods.laplace.structure import Curvature

#: every structure a Laplace posterior can hold, by its ``hessian=`` name
STRUCTURES: dict[str, type[Curvature]] = {"kron": KronCurvature, "full": FullCurvature, "diag": DiagCurvature}
#: fitting variants held in another structure's form
VARIANTS = {"kron-mc": "kron"}


def structure_class(hessian: str) -> type[Curvature]:
    """The class holding the curvature of ``hessian`` (one of :data:`STRUCTURES` or :data:`VARIANTS`)."""
    return STRUCTURES[VARIANTS.get(hessian, hessian)]
