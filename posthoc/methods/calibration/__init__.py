"""Calibrators: maps from logits to calibrated probabilities fitted on held-out data (one module each, on the contract
of :mod:`~posthoc.methods.calibration.base`), and the methods that stack them on any predictive.
"""

from posthoc.methods.calibration import auto, venn_abers  # noqa: F401  (importing them registers every calibrator)
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.method import calibrators

__all__ = ["Calibrator", "calibrators"]
