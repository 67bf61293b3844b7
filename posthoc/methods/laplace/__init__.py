"""The ``"laplace"`` method: :class:`Laplace` (the registered common base, which builds the algorithm for
its options) and its two algorithms, :class:`LastLayerLaplace` and :class:`SubsetLaplace` (see
:mod:`posthoc.methods.laplace.base`); the fitted curvature is one typed block per structure
(:mod:`~posthoc.methods.laplace.kron`, :mod:`~posthoc.methods.laplace.diag`, :mod:`~posthoc.methods.laplace.full`)."""

from posthoc.methods.laplace.base import Laplace
from posthoc.methods.laplace.last_layer import LastLayerLaplace
from posthoc.methods.laplace.subset import SubsetLaplace

__all__ = ["Laplace", "LastLayerLaplace", "SubsetLaplace"]
