"""Calibrators: maps from logits to calibrated probabilities fitted on held-out data, and the stacked
methods that fit them on top of any predictive (``posthoc.wrap(model, method=["laplace", "vector"])``).

One module per calibrator (``temperature``, ``vector``, ``matrix``, ``dirichlet``, ``ets``,
``histogram``, ``isotonic``, ``platt``, ``identity``, ``auto``) on the contract of
:mod:`posthoc.methods.calibration.base`; :mod:`~posthoc.methods.calibration.stacked` registers them
as methods.
"""

from posthoc.methods.calibration import auto, stacked  # noqa: F401  (importing them registers every calibrator)
from posthoc.methods.calibration.base import CALIBRATORS, Calibrator

__all__ = ["CALIBRATORS", "Calibrator"]
