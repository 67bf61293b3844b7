"""The ``"laplace"`` method: :class:`Laplace` and its two algorithms (see :mod:`posthoc.methods.laplace.base`)."""

from posthoc.methods.laplace.base import Laplace
from posthoc.methods.laplace.last_layer import LastLayerLaplace
from posthoc.methods.laplace.subset import SubsetLaplace

__all__ = ["Laplace", "LastLayerLaplace", "SubsetLaplace"]
