"""posthoc: retrofit uncertainty onto already trained PyTorch classifiers.

Example:
    >>> import posthoc
    >>> um = posthoc.wrap(model, method="laplace").fit(train_loader)
    >>> pred = um.predict(x)            # probs, entropy, aleatoric / epistemic split
    >>> report = posthoc.evaluate(um, test_loader)
"""

from posthoc import api, methods  # noqa: F401  (importing methods registers them)
from posthoc.api import available_methods, register, wrap
from posthoc.base import Method, UncertainModel
from posthoc.calibrate import calibrate
from posthoc.errors import (
    ConfigError,
    HeadNotFoundError,
    InputError,
    NotFittedError,
    NumericalError,
    PosteriorFileError,
    PosthocError,
)
from posthoc.persist import load
from posthoc.prediction import Prediction
from posthoc.report import Report, evaluate

wrap.__doc__ = (wrap.__doc__ or "") + api.methods_doc()

__version__ = "0.1.0"

__all__ = [
    "wrap", "load", "evaluate", "calibrate", "register", "available_methods",
    "Prediction", "Report", "UncertainModel", "Method",
    "PosthocError", "ConfigError", "InputError", "NotFittedError", "HeadNotFoundError",
    "PosteriorFileError", "NumericalError",
]
