"""The ``"laplace"`` method: :class:`Laplace` (the registered front and common base) and its two
algorithms, :class:`LastLayerLaplace` and :class:`SubsetLaplace` (see :mod:`posthoc.methods.laplace.base`)."""

from posthoc.methods.laplace.base import Laplace
from posthoc.methods.laplace.last_layer import LastLayerLaplace
from posthoc.methods.laplace.subset import SubsetLaplace

__all__ = ["Laplace", "LastLayerLaplace", "SubsetLaplace"]
