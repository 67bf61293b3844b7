"""The key map from ``hessian=`` to the :class:`~posthoc.methods.laplace.structure.Curvature` class that holds it.

``"kron-mc"`` (BackPACK's sampled KFAC) is held as ``"kron"``. A last-layer ``"kron"`` over more than
:data:`MANY_CLASSES` classes is held as ``"kron-diag"``: KFAC's ``C x C`` output factor would cost more than the head.

Example:
    >>> from posthoc.methods.laplace.structures import head_structure, structure_class
    >>> structure_class("kron-mc").__name__
    'KronCurvature'
    >>> head_structure("kron", 100), head_structure("kron", 50_000), head_structure("diag", 50_000)
    ('kron', 'kron-diag', 'diag')
"""

from __future__ import annotations

from posthoc.methods.laplace.diag import DiagCurvature
from posthoc.methods.laplace.full import FullCurvature
from posthoc.methods.laplace.kron import KronCurvature
from posthoc.methods.laplace.kron_diag import KronDiagCurvature
from posthoc.methods.laplace.structure import Curvature

#: every structure a Laplace posterior can hold, by its ``hessian=`` name
STRUCTURES: dict[str, type[Curvature]] = {
    "kron": KronCurvature,
    "full": FullCurvature,
    "diag": DiagCurvature,
    "kron-diag": KronDiagCurvature,
}
#: fitting variants held in another structure's form
VARIANTS = {"kron-mc": "kron"}
#: a last-layer ``"kron"`` above this many classes is held as ``"kron-diag"`` (see module docs)
MANY_CLASSES = 4096


def structure_class(hessian: str) -> type[Curvature]:
    """The class holding the curvature of ``hessian`` (one of :data:`STRUCTURES` or :data:`VARIANTS`)."""
    return STRUCTURES[VARIANTS.get(hessian, hessian)]


def head_structure(hessian: str, classes: int) -> str:
    """The structure a last-layer ``hessian`` is held in for a head of ``classes`` outputs (see module docs)."""
    return "kron-diag" if hessian == "kron" and classes > MANY_CLASSES else hessian
