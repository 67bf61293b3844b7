"""The :class:`Calibrator` contract: a map from logits ``(..., C)`` to calibrated log-probabilities.

A calibrator is fitted on held-out logits and labels, applies to logits ``(N, C)`` (and, where ``per_sample``, to
per-sample logits ``(S, N, C)``), keeps its fitted parameters in buffers and saves to a file that
``posthoc.calibrate.load`` reads back. Two held-out sets determine no map, for every calibrator: too few examples (an
:class:`~posthoc.errors.InputError` naming the minimum), and a (nearly) separated one, with fewer than
:data:`MIN_ERRORS` errors, whose likelihood keeps improving as the map sharpens: the calibrator stays the identity
and warns.

A :class:`RegressionCalibrator` is fitted on a held-out :class:`~posthoc.RegressionPrediction` and its targets
instead; a deployed regressor's numbers (``mean``, and ``std`` or none: a constant 1) become one by
:func:`as_prediction`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core.inputs import as_tensor, check_labels, like_given
from posthoc.core.logits import as_class_logits, check_finite_logits, check_not_probabilities, log_mean_exp
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.engine.runner import small_fit
from posthoc.errors import ConfigError, ExportError, InputError
from posthoc.export.build import IN_PROCESS, calibrator_module
from posthoc.export.modules import FunctionMap, LogSoftmax
from posthoc.methods.calibration.options import CalibratorOptions

#: errors a separated held-out set would need to hold before a map can be fitted on it
ERRORS_WANTED = 10
#: a held-out set with fewer errors than this is nearly separable: the map stays the identity (module docs)
MIN_ERRORS = 2


def held_out_logits(logits: Any, labels: Any, *, samples: bool = True) -> tuple[Tensor, Tensor]:
    """Held-out ``logits`` as class logits ``(N, C)`` (a binary classifier's ``(N,)`` as ``[0, z]``) or, with
    ``samples``, per-sample logits ``(S, N, C)``, and ``labels`` as int64 class indices ``(N,)``.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.base import held_out_logits
        >>> logits, labels = held_out_logits(torch.tensor([0.5, -1.0]), [1.0, 0.0])
        >>> logits.shape, labels.dtype
        (torch.Size([2, 2]), torch.int64)
    """
    logits, labels = as_tensor(logits, "logits"), as_tensor(labels, "labels", numbers=True)
    if labels.dim() == 0:
        raise InputError(
            f"labels is one number, not one label per example; pass held-out logits (N, C) and labels (N,) (logits of "
            f"shape {tuple(logits.shape)} here: one example's logits need their batch dimension, logits[None], and a "
            "calibrator needs many examples)"
        )
    if logits.dim() < 3 or not samples:
        logits = as_class_logits(logits)
    if labels.dim() == 2 and labels.shape[1] > 1:  # one-hot rows are refused by name before their count is
        check_labels(labels, logits.shape[-1])
    if logits.shape[-2] != labels.reshape(-1).shape[0]:
        raise InputError(
            f"logits and labels have different lengths ({logits.shape[-2]} vs {labels.reshape(-1).shape[0]}); "
            "pass one label per row of logits"
        )
    if logits.shape[-2] == 0:
        raise InputError("calibrate got no examples; pass held-out logits and labels")
    return logits, check_labels(labels, logits.shape[-1])


def predictive(log_probs: Tensor) -> Tensor:
    """The predictive log-probabilities ``(N, C)`` of ``(N, C)`` log-probs or of samples ``(S, N, C)``."""
    return log_mean_exp(log_probs) if log_probs.dim() == 3 else log_probs


class Calibrator(CalibratorOptions, nn.Module):
    """Base class: fit with :meth:`fit`, then call on logits for probabilities.

    Subclasses set ``name``, declare their ``Options``
    (:class:`~posthoc.methods.calibration.options.CalibratorOptions`), keep fitted parameters in buffers and implement
    :meth:`_fit` and :meth:`map_parts` (or :meth:`_transform`).

    """

    name: ClassVar[str] = ""
    likelihood: ClassVar[str] = "classification"
    #: whether the map applies to each posterior sample; otherwise to the predictive (mean over samples)
    per_sample: ClassVar[bool] = True
    min_examples: ClassVar[int] = 10
    #: the fewest examples of every class it accepts (maps with per-class parameters)
    min_per_class: ClassVar[int] = 0
    binary_only: ClassVar[bool] = False
    #: whether two fits can be blended parameter by parameter (not histogram bins or isotonic steps)
    interpolable: ClassVar[bool] = True
    #: the simpler calibrator this one extends (more free parameters, the same job): ``"auto"`` admits it only where its
    #: held-out gain over that one is sure (:func:`posthoc.engine.selection.select`'s ``extends``); ``None``: none
    extends: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("num_classes", torch.zeros((), dtype=torch.long))
        self.register_buffer("passthrough", torch.tensor(False))

    def num_parameters(self) -> int:
        """How many scalar parameters the fitted map has (the model card's ``random_variables``)."""
        return sum(value.numel() for name, value in self.named_buffers() if name not in ("num_classes", "passthrough"))

    @classmethod
    def requirement(cls, labels: Tensor, num_classes: int) -> str | None:
        """Why ``labels`` are too few for this calibrator (naming the minimum), or ``None`` if enough."""
        if cls.binary_only and num_classes != 2:
            return (
                f"'{cls.name}' calibrates binary classifiers (one logit, or two classes); these logits have "
                f"{num_classes} classes: use 'temperature', 'vector' or 'matrix'"
            )
        if labels.numel() < cls.min_examples:
            return f"'{cls.name}' needs at least {cls.min_examples} held-out examples, got {labels.numel()}"
        if cls.min_per_class:
            counts = torch.bincount(labels, minlength=num_classes)
            short = (counts < cls.min_per_class).nonzero().reshape(-1).tolist()
            if short:
                listing = ", ".join(f"class {c}: {int(counts[c])}" for c in short[:5]) + (
                    " ..." if len(short) > 5 else ""
                )
                return (
                    f"'{cls.name}' has per-class parameters and needs at least {cls.min_per_class} held-out "
                    f"examples of every class ({listing}); collect more, or use 'temperature'"
                )
        return None

    def check(self, labels: Tensor, num_classes: int) -> None:
        """Refuse too few labels (naming the minimum) and labels of a single class."""
        if self.binary_only and num_classes != 2:
            raise ConfigError(self.requirement(labels, num_classes))
        problem = self.requirement(labels, num_classes)
        if problem is not None and labels.numel() < self.min_examples:
            raise InputError(problem)
        present = torch.unique(labels)
        if present.numel() < 2:
            raise InputError(
                f"all {labels.numel()} held-out labels are class {int(present[0]) if present.numel() else '-'}: "
                "a calibrator needs held-out examples of at least two classes (a held-out set of one class "
                "says nothing about how confident the model should be between classes)"
            )
        if problem is not None:
            raise InputError(problem)

    def fit(self, logits: Any, labels: Any) -> Calibrator:
        """Fit on held-out logits and labels (as :func:`held_out_logits` reads them); returns ``self``."""
        logits, labels = held_out_logits(logits, labels)
        labels = labels.to(logits.device)
        self.check(labels, logits.shape[-1])
        self.num_classes.fill_(logits.shape[-1])
        self.passthrough.fill_(False)
        self._reset()
        inputs = logits.detach().double()
        errors = int((predictive(torch.log_softmax(inputs, -1)).argmax(-1) != labels).sum())
        if errors < MIN_ERRORS:
            self._warn_separated(labels.numel(), errors)
            self.passthrough.fill_(True)
            return self
        with small_fit(inputs):
            self._fit(inputs, labels)
        return self

    def _warn_separated(self, count: int, errors: int = 0) -> None:
        wanted = math.ceil(ERRORS_WANTED * count / 3)
        which = "all" if not errors else f"all but {errors} of the"
        warnings.warn(
            f"{which} {count} held-out examples are classified correctly, so they cannot determine '{self.name}' "
            "calibration (its likelihood keeps improving as the predictions are sharpened, which would make the "
            f"model overconfident on new data; and a cross-fitted check never sees a lone error): keeping the model's "
            f"own probabilities. With {errors or 'no'} error among {count} examples the error rate is below about "
            f"{3 + errors}/{count}; a held-out set of about {wanted} examples would hold ~{ERRORS_WANTED} errors to "
            "fit on",
            RuntimeWarning,
            stacklevel=3,
        )

    def _reset(self) -> None:
        """Set the parameters to the identity map (before a fit, which may keep it)."""

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        """Fit the parameters on float64 logits ``(N, C)`` or per-sample logits ``(S, N, C)``."""
        raise NotImplementedError

    def transform(self, logits: Tensor) -> Tensor:
        """Calibrated log-probabilities for class logits ``(..., C)`` (same shape)."""
        expected = int(self.num_classes)
        if expected and logits.shape[-1] != expected:
            raise InputError(
                f"this '{self.chosen_name}' calibrator was fitted on {expected} classes but got logits with "
                f"{logits.shape[-1]}; pass logits of the classifier it was fitted for, rows (N, {expected}) (one "
                "example's logits without their batch dimension read as a binary classifier's N logits: pass "
                "logits[None])"
            )
        if bool(self.passthrough):
            return torch.log_softmax(logits, -1)
        return self._transform(logits)

    def _transform(self, logits: Tensor) -> Tensor:
        function, tensors, constants = self.map_parts()
        return function(logits, **tensors, **constants)

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        """The fitted map as ``(function, tensors, constants)``: log-probabilities ``function(logits, **tensors,
        **constants)``. Defined here, so that the map applied and the map exported are one function.

        Example:
            >>> from posthoc.methods.calibration.temperature import TemperatureCalibrator
            >>> function, tensors, constants = TemperatureCalibrator().map_parts()
            >>> function.__name__, sorted(tensors), constants
            ('temperature_log_probs', ['temperature'], {})
        """
        raise ExportError(
            f"the calibrator '{self.name}' ({type(self).__name__}) has no exported form yet; {IN_PROCESS}"
        )

    def log_prob_map(self) -> nn.Module:
        """This fitted map as a plain module (:meth:`map_parts`, tensors as buffers): logits to log-probabilities."""
        if bool(self.passthrough):
            return LogSoftmax()
        return FunctionMap(*self.map_parts())

    def calibrated_predictive(self, logits: Tensor) -> Tensor:
        """Calibrated predictive log-probabilities ``(N, C)`` for logits ``(N, C)`` or samples ``(S, N, C)``:
        a ``per_sample`` map calibrates each sample before they are averaged, the others the average."""
        if logits.dim() == 2:
            return self.transform(logits)
        if self.per_sample:
            return predictive(self.transform(logits))
        return self.transform(predictive(torch.log_softmax(logits, -1)))

    def log_probs(self, logits: Any) -> Tensor:
        """Calibrated log-probabilities ``(N, C)`` of logits ``(N, C)`` (or ``(N,)``), numpy for numpy logits.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import logits, labels, test_logits
            >>> calibrator = posthoc.calibrate(logits, labels)
            >>> calibrator.log_probs(test_logits).exp().sum(-1).round(decimals=4)[:3]   # the last digits vary by build
            tensor([1., 1., 1.])
            >>> type(calibrator.log_probs(test_logits.numpy())).__name__
            'ndarray'
        """
        return like_given(self._log_probs(logits), logits)

    def _log_probs(self, logits: Any) -> Tensor:
        """The calibrated log-probabilities, computed in float32 and given back in the logits' floating dtype."""
        logits = as_tensor(logits, "logits")
        check_finite_logits(logits)
        check_not_probabilities(logits)
        dtype = logits.dtype if logits.is_floating_point() else torch.float32
        logits = as_class_logits(logits).float()
        buffers = [value for value in self.buffers() if value.is_floating_point()]
        device = buffers[0].device if buffers else logits.device
        return self.transform(logits.to(device)).to(dtype)

    def predict(self, logits: Any) -> Prediction:
        """The calibrated :class:`~posthoc.Prediction` for ``logits`` (tensors, for numpy logits too)."""
        return Prediction.from_log_probs(self._log_probs(logits))

    def forward(self, logits: Any) -> Tensor:
        """Calibrated probabilities ``(N, C)``: ``calibrator(logits)``; a numpy array for numpy logits."""
        return like_given(self._log_probs(logits).exp(), logits)

    def to_module(self) -> nn.Module:
        """This fitted calibrator as a self-contained ``nn.Module``, logits in, calibrated probabilities out, that
        ``torch.export`` and ONNX take.

        Example:
            >>> import posthoc, torch
            >>> logits, labels = torch.randn(200, 3) * 3, torch.randint(0, 3, (200,))
            >>> calibrator = posthoc.calibrate(logits, labels, method="temperature")
            >>> torch.allclose(calibrator.to_module()(logits), calibrator(logits), atol=1e-6)
            True
        """
        return calibrator_module(self)

    def extra_repr(self) -> str:
        return f"calibrator={self.chosen_name!r}, classes={int(self.num_classes)}" + (
            ", identity" if bool(self.passthrough) else ""
        )


#: what a regression calibrator's saved spec records, beside its name and options
KIND = "regression"


def as_prediction(mean: Any, std: Any = None) -> RegressionPrediction:
    """The Gaussian predictive ``N(mean, std²)`` of a deployed regressor's numbers (``std=None``: 1), all noise.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.base import as_prediction
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
    """Refuse, for the calibrator's ``what`` (``fit``, ``calibrate``), anything but a :class:`RegressionPrediction`.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.base import check_regression_prediction
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

    Subclasses set ``name``, declare their ``Options`` as :class:`Calibrator` does, keep fitted parameters in buffers
    and implement :meth:`_fit` and :meth:`_calibrate`.
    """

    name: ClassVar[str] = ""
    likelihood: ClassVar[str] = "regression"
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
            >>> from posthoc_apps.demo.examples import reg_val_loader, regression_um
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
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import reg_val_loader, regression_um, reg_x
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
        """The calibrated predictive of a deployed regressor's ``mean`` and ``std`` (:func:`as_prediction`).

        Example:
            >>> import posthoc, torch
            >>> val_mean, test_mean, std = torch.randn(500), torch.randn(500), torch.full((500,), 2.0)
            >>> calibrator = posthoc.calibrate(mean=val_mean, std=std, targets=val_mean + torch.randn(500))
            >>> calibrator.predict(test_mean, std).interval(0.9)[0].shape
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


class RegressionIdentity(RegressionCalibrator):
    """The predictive as it is: the reference of ``"auto"``."""

    name = "identity"

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        pass

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        return prediction
