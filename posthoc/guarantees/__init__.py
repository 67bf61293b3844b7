"""Guarantees on top of any predictive: conformal prediction sets, conformal risk control of
masks and multi-label outputs, and selective prediction (deferral).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, regression_um, reg_val_loader
    >>> cp = posthoc.conformal(val_probs, val_labels, alpha=0.1)         # sets hold the label w.p. >= 0.9
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)  # intervals hold y w.p. >= 0.9
    >>> from torch.nn.functional import one_hot
    >>> rc = posthoc.risk_control(val_probs, one_hot(val_labels, 3), alpha=0.1)   # masks miss <= 10% of labels
    >>> ltt = posthoc.risk_control(val_probs, one_hot(val_labels, 3), alpha=[0.25, 0.6], loss=["fnr", "size"],
    ...                            method="ltt")                       # both, with probability >= 0.9
    >>> sel = posthoc.selective(val_probs, val_labels, target_risk=0.25)  # accepted error <= 25% w.p. >= 0.95
"""

from posthoc.guarantees.conformal import ConformalPredictor, ConformalRegressor, conformal
from posthoc.guarantees.covariate_shift import WeightedConformalPredictor
from posthoc.guarantees.learn_then_test import MultiRiskController
from posthoc.guarantees.risk_control import RiskController, risk_control
from posthoc.guarantees.selective import RiskNotReachableError, SelectivePredictor, selective

__all__ = [
    "conformal",
    "selective",
    "risk_control",
    "RiskController",
    "MultiRiskController",
    "ConformalPredictor",
    "ConformalRegressor",
    "WeightedConformalPredictor",
    "SelectivePredictor",
    "RiskNotReachableError",
]
