"""Calibrators: maps from logits to calibrated probabilities fitted on held-out data, and the methods
that stack them on any predictive (``posthoc.wrap(model, method=["laplace", "vector"])``).

One module per calibrator on the contract of :mod:`posthoc.methods.calibration.base`;
:mod:`~posthoc.methods.calibration.method` registers each as a method.
"""

from posthoc.methods.calibration import auto  # noqa: F401  (importing it registers every calibrator)
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.method import calibrators

__all__ = ["Calibrator", "calibrators"]
