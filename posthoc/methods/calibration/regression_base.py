"""The :class:`RegressionCalibrator` contract: a map from a regression predictive to a calibrated one.

A regression calibrator is fitted on a held-out :class:`~posthoc.core.prediction.RegressionPrediction`
and its targets, maps any prediction of the same outputs to a calibrated one, keeps its fitted parameters
in buffers, and saves to a calibrator file (``posthoc.calibrate.load`` reads it back). A deployed
regressor that only has numbers gives them as ``mean`` ``(N,)`` / ``(N, D)`` and ``std`` of that shape, or
no ``std`` (a constant std of 1, so that variance scaling fits the homoscedastic noise: its scale is then
the root mean squared residual): :func:`as_prediction` builds the one-Gaussian predictive.

Apart from :mod:`~posthoc.methods.calibration.base` because a regression calibrator maps a predictive's CDF over
real targets (a scale, a monotone map of levels), a classification one maps logits to class probabilities.

Example:
>>> val_mean, test_mean = torch.randn(500), torch.randn(500)     # a regressor's predictions,
    >>> val_std = test_std = torch.full((500,), 2.0)                 # whose stds are twice too wide
    >>> val_y, test_y = val_mean + torch.randn(500), test_mean + torch.randn(500)
    >>> from posthoc.methods.calibration.variance_scaling import VarianceScaling
    >>> calibrator = VarianceScaling().fit(as_prediction(val_mean, val_std), val_y)
    >>> lower, upper = calibrator.predict(test_mean, test_std).interval(0.9)
    >>> ((lower[:, 0] <= test_y) & (test_y <= upper[:, 0])).float().mean()     # about 0.9
    tensor(0.9...)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core.inputs import as_tensor
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.errors import InputError
from posthoc.methods.calibration.options import CalibratorOptions

#: what a regression calibrator's saved spec records, beside its name and options
KIND = "regression"


def as_prediction(mean: Any, std: Any = None) -> RegressionPrediction:
    """The Gaussian predictive ``N(mean, std²)`` of a deployed regressor's numbers (``std=None``: 1 everywhere).

    The variance is recorded as observation noise (the numbers do not say how it splits).

    Example:
        >>> as_prediction(torch.zeros(3), torch.full((3,), 2.0)).std.shape
        torch.Size([3, 1])
    """
    if isinstance(mean, (RegressionPrediction, Prediction)):
        raise InputError(
            f"mean= takes the predicted means (numbers), got a {type(mean).__name__}; for a wrapped "
            "regressor's prediction call calibrator.calibrate(um.predict(x)) (or pass mean=pred.mean, "
            "std=pred.std)"
        )
    mean = as_tensor(mean, "mean").double()
    if mean.dim() == 1:
        mean = mean[:, None]
    if mean.dim() != 2 or mean.shape[0] == 0:
        raise InputError(f"mean must be (N,) or (N, D) with N > 0, got shape {tuple(mean.shape)}")
    std = torch.ones_like(mean) if std is None else as_tensor(std, "std").double()
    if std.dim() == 1 and mean.shape[1] == 1:
        std = std[:, None]
    if std.shape != mean.shape:
        raise InputError(f"std has shape {tuple(std.shape)} but mean has {tuple(mean.shape)}; pass one std per mean")
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
        raise InputError("mean or std contain NaN or inf; drop or impute those rows")
    if not bool((std > 0).all()):
        raise InputError(
            f"every std must be > 0 (got a minimum of {float(std.min()):.3g}); pass the predictive "
            "standard deviation, not a variance or log-variance, and drop rows with std <= 0"
        )
    return RegressionPrediction.from_components(mean[None], None, std.square()[None])


def check_regression_prediction(prediction: Any, what: str) -> None:
    """Refuse, for the calibrator's ``what`` (``fit``, ``calibrate``), anything but a :class:`RegressionPrediction`,
    saying what to pass instead (a classifier's :class:`~posthoc.Prediction`, numbers).

    Example:
        >>> check_regression_prediction(torch.zeros(3), "calibrate")
        Traceback (most recent call last):
        posthoc.errors.InputError: a regression calibrator's calibrate takes a posthoc.RegressionPrediction...
    """
    if isinstance(prediction, RegressionPrediction):
        return
    instead = (
        "a classifier's posthoc.Prediction: calibrate a classifier with posthoc.calibrate(logits, labels) "
        "or a classification calibrator"
        if isinstance(prediction, Prediction)
        else f"a {type(prediction).__name__}: for a deployed regressor's numbers use calibrator.predict(mean, std)"
    )
    raise InputError(
        f"a regression calibrator's {what} takes a posthoc.RegressionPrediction (um.predict(x) of a model "
        f"wrapped with likelihood='regression'), got {instead}"
    )


class RegressionCalibrator(CalibratorOptions, nn.Module):
    """Base class: :meth:`fit` on a held-out prediction and targets, then :meth:`calibrate` predictions.

    Subclasses set ``name``, declare options as the fields of a nested ``Options(RegressionCalibrator.Options)``
    dataclass that ``__init__`` also takes as keyword-only arguments with the same defaults (see
    :class:`~posthoc.methods.calibration.options.CalibratorOptions`), keep fitted parameters in buffers and
    implement :meth:`_fit` and :meth:`_calibrate`.

    Class attributes:
        name: the name ``posthoc.calibrate(mean=..., method=...)`` takes (and a saved file records).
        min_examples: the fewest held-out examples it accepts.
    """

    name: ClassVar[str] = ""
    min_examples: ClassVar[int] = 10

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("num_outputs", torch.zeros((), dtype=torch.long))
        #: fitted on means alone (a constant std of 1): then it calibrates means alone
        self.register_buffer("unit_std", torch.tensor(False))

    def num_parameters(self) -> int:
        """How many scalar parameters the fitted map has."""
        return sum(
            value.numel()
            for name, value in self.named_buffers()
            if name.rpartition(".")[2] not in ("num_outputs", "unit_std")
        )

    def fit(self, prediction: RegressionPrediction, targets: Any) -> RegressionCalibrator:
        """Fit on a held-out ``prediction`` and its ``targets`` ``(N,)`` or ``(N, D)``; returns ``self``.

        Example:
            >>> from posthoc.methods.calibration.variance_scaling import VarianceScaling
            >>> x_val, y_val = reg_val_loader.dataset.tensors
            >>> VarianceScaling().fit(regression_um.predict(x_val), y_val).scale.shape     # one per output
            torch.Size([1])
        """
        check_regression_prediction(prediction, "fit")
        if prediction.recalibrated:
            raise InputError("the prediction to fit on is already recalibrated (isotonic); fit on the uncalibrated one")
        y = prediction.distribution.targets(targets).double()
        exact = ((y - prediction.mean.double()) == 0).all(0).nonzero().flatten().tolist()
        if exact:
            raise InputError(
                f"the predicted means equal every target of output(s) {exact} exactly, so no calibration "
                "map can be fitted (variance scaling would shrink the std to 0); calibrate on held-out "
                "targets the model was not fitted to"
            )
        if y.shape[0] < self.min_examples:
            raise InputError(f"'{self.name}' needs at least {self.min_examples} held-out examples, got {y.shape[0]}")
        self.num_outputs.fill_(prediction.num_outputs)
        self._fit(_float64(prediction), y)
        return self

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        raise NotImplementedError

    def calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        """The calibrated prediction of ``prediction`` (the outputs it was fitted for).

        Example:
            >>> x_val, y_val = reg_val_loader.dataset.tensors
            >>> calibrator = posthoc.calibrate(mean=regression_um.predict(x_val).mean, targets=y_val)
            >>> lower, upper = calibrator.calibrate(regression_um.predict(reg_x)).interval(0.9)
            >>> bool((lower < upper).all())
            True
        """
        check_regression_prediction(prediction, "calibrate")
        expected = int(self.num_outputs)
        if expected == 0:
            raise InputError(
                f"this '{self.name}' calibrator is not fitted: call .fit(prediction, targets) or "
                "posthoc.calibrate(mean=..., std=..., targets=...) first"
            )
        if prediction.num_outputs != expected:
            raise InputError(
                f"this '{self.chosen_name}' calibrator was fitted on {expected} output(s) but got a prediction "
                f"of {prediction.num_outputs}; pass predictions of the model it was fitted for"
            )
        return self._calibrate(prediction)

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        raise NotImplementedError

    def predict(self, mean: Any, std: Any = None) -> RegressionPrediction:
        """The calibrated predictive of a deployed regressor's ``mean`` and ``std`` (see module docs).

                Example:
        >>> val_mean, test_mean = torch.randn(500), torch.randn(500)     # a regressor's predictions,
                    >>> val_std = test_std = torch.full((500,), 2.0)                 # whose stds are twice too wide
                    >>> val_y, test_y = val_mean + torch.randn(500), test_mean + torch.randn(500)
                    >>> calibrator = posthoc.calibrate(mean=val_mean, std=val_std, targets=val_y)
                    >>> lower, upper = calibrator.predict(test_mean, test_std).interval(0.9)
                    >>> lower.shape
                    torch.Size([500, 1])
        """
        prediction = as_prediction(mean, std)
        if bool(self.unit_std) != (std is None):
            raise InputError(
                "this calibrator was fitted on means alone: call it with mean only"
                if bool(self.unit_std)
                else "this calibrator was fitted on means and stds: pass std= too"
            )
        return self.calibrate(prediction)

    def forward(self, mean: Any, std: Any = None) -> RegressionPrediction:
        """``calibrator(mean, std)``: :meth:`predict`."""
        return self.predict(mean, std)

    def file_entry(self) -> dict[str, Any]:
        """Its name and options, and that it calibrates regression predictions."""
        return {**super().file_entry(), "kind": KIND}

    def extra_repr(self) -> str:
        return f"calibrator={self.chosen_name!r}, outputs={int(self.num_outputs)}"


def _float64(prediction: RegressionPrediction) -> RegressionPrediction:
    return RegressionPrediction.from_components(
        prediction.component_means.double(), prediction.model_variances.double(), prediction.noise.double()
    )
