"""Guarantees on top of any predictive: conformal prediction sets and selective prediction (deferral).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, regression_um, reg_val_loader
    >>> cp = posthoc.conformal(val_probs, val_labels, alpha=0.1)         # sets hold the label w.p. >= 0.9
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)  # intervals hold y w.p. >= 0.9
    >>> sel = posthoc.selective(val_probs, val_labels, target_risk=0.25)  # accepted error <= 25% w.p. >= 0.95
"""

from posthoc.guarantees.conformal import ConformalPredictor, ConformalRegressor, conformal
from posthoc.guarantees.selective import RiskNotReachableError, SelectivePredictor, selective

__all__ = [
    "conformal",
    "selective",
    "ConformalPredictor",
    "ConformalRegressor",
    "SelectivePredictor",
    "RiskNotReachableError",
]
