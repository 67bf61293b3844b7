"""posthoc: retrofit uncertainty onto already trained PyTorch classifiers and regressors.

Example:
    >>> from posthoc_apps.demo.examples import model, train_loader, x, test_loader
    >>> import posthoc
    >>> um = posthoc.wrap(model, method="laplace").fit(train_loader)
    >>> pred = um.predict(x)            # probs, entropy, aleatoric / epistemic split
    >>> report = posthoc.evaluate(um, test_loader)
"""

from posthoc import errors, export, methods, settings, shift  # noqa: F401  (importing them registers the methods)
from posthoc.api import load, wrap
from posthoc.calibrate import calibrate
from posthoc.core.likelihood import Gaussian, HeteroscedasticGaussian
from posthoc.core.method import Method
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.core.registry import available_methods, register
from posthoc.engine.selection import Tolerance
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import (
    ConfigError,
    ExportError,
    HeadNotFoundError,
    InputError,
    NotFittedError,
    NumericalError,
    PosteriorFileError,
    PosthocError,
)
from posthoc.evaluation.compare import Comparison, compare
from posthoc.evaluation.report import Report, evaluate
from posthoc.evaluation.shift import ShiftTable, evaluate_shift
from posthoc.guarantees import RiskController, conformal, risk_control, selective
from posthoc.label_shift import label_shift
from posthoc.methods.swag.collector import SWAGCollector
from posthoc.ood import Detector, detector

__version__ = "0.1.0"

__all__ = [
    "wrap",
    "load",
    "evaluate",
    "compare",
    "Comparison",
    "evaluate_shift",
    "ShiftTable",
    "shift",
    "calibrate",
    "label_shift",
    "conformal",
    "selective",
    "risk_control",
    "RiskController",
    "register",
    "available_methods",
    "settings",
    "detector",
    "Detector",
    "Prediction",
    "Report",
    "UncertainModel",
    "Method",
    "Tolerance",
    "SWAGCollector",
    "Gaussian",
    "HeteroscedasticGaussian",
    "RegressionPrediction",
    "PosthocError",
    "ConfigError",
    "InputError",
    "NotFittedError",
    "HeadNotFoundError",
    "PosteriorFileError",
    "NumericalError",
    "ExportError",
]
