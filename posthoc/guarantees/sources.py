"""Where the predictions behind a guarantee come from, at calibration and at test time.

A guarantee is calibrated on probabilities or logits ``(N, C)`` with ``labels`` (``inputs="auto"`` tells them apart:
rows in ``[0, 1]`` summing to 1 are probabilities), a :class:`~posthoc.Prediction` with ``labels``, or a fitted
:class:`~posthoc.UncertainModel` with a labelled loader. At test time the same kind is expected again (a
:class:`Predictive` remembers it); a ``Prediction`` is always accepted.

Example:
    >>> from posthoc.guarantees.sources import calibration_predictions
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, test_probs
    >>> predictive, pred, labels = calibration_predictions(val_probs, val_labels, inputs="auto")
    >>> predictive.kind
    'probs'
    >>> predictive(test_probs).probs.shape
    torch.Size([128, 3])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from posthoc.core.checks import one_of
from posthoc.core.inputs import arrays_pair, as_tensor, check_labels, loader_fix, looks_like_loader
from posthoc.core.logits import looks_like_probabilities
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.engine.predictions import predict_loader
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError

INPUT_KINDS = ("auto", "probs", "logits")


def as_float_tensor(values: Any, what: str) -> Tensor:
    """A ``(N, C)`` float64 tensor from a tensor or numpy array, refusing other shapes and non-finite values.

    Example:
        >>> import numpy as np
        >>> from posthoc.guarantees.sources import as_float_tensor
        >>> as_float_tensor(np.eye(2), "probabilities").dtype
        torch.float64
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "biuf":
            raise InputError(f"{what} must be numbers, got a numpy array of dtype {values.dtype}")
        values = torch.from_numpy(values)
    if not isinstance(values, Tensor):
        raise InputError(f"{what} must be a tensor, a numpy array or a posthoc.Prediction, got {type(values).__name__}")
    if values.dim() != 2 or values.shape[1] < 2:
        one = (
            " (one example: add its batch dimension, values[None])"
            if values.dim() == 1
            else (
                " (a binary classifier's one logit z per row: pass the two-class logits torch.cat([torch.zeros_like(z), "
                "z], 1), or its probabilities)"
                if values.dim() == 2 and values.shape[1] == 1
                else ""
            )
        )
        raise InputError(f"{what} must have shape (N, C) with C >= 2 classes, got {tuple(values.shape)}{one}")
    if values.shape[0] == 0:
        raise InputError(f"{what} hold no examples (shape {tuple(values.shape)})")
    values = values.detach().double().cpu()
    if not torch.isfinite(values).all():
        raise InputError(f"{what} contain NaN or inf; clean them (or drop those rows) first")
    return values


def as_labels(labels: Any, num_classes: int, count: int) -> Tensor:
    """``labels`` as int64 class indices in ``[0, num_classes)``, one per example.

    Example:
        >>> import numpy as np
        >>> from posthoc.guarantees.sources import as_labels
        >>> as_labels(np.array([0, 2]), 3, 2)
        tensor([0, 2])
    """
    if looks_like_loader(labels):
        raise InputError(
            "calibrated on probabilities, logits or a Prediction, the labels are class indices (N,), not a "
            "loader of batches; to calibrate on a loader pass the wrapped model with it, e.g. "
            "posthoc.conformal(um, calibration_loader)"
        )
    if isinstance(labels, (list, tuple)):
        labels = as_tensor(labels, "labels")
    if isinstance(labels, np.ndarray):
        if labels.dtype.kind not in "biuf":
            raise InputError(
                f"labels must be integer class indices in [0, {num_classes}), got a numpy array of "
                f"dtype {labels.dtype}; map them first, e.g. np.unique(labels, return_inverse=True)[1]"
            )
        labels = torch.from_numpy(labels)
    if not isinstance(labels, Tensor):
        raise InputError(f"labels must be a tensor or a numpy array of class indices, got {type(labels).__name__}")
    labels = check_labels(labels.detach().cpu(), num_classes)
    if labels.numel() != count:
        raise InputError(f"got {count} calibration examples but {labels.numel()} labels; pass one label per row")
    return labels


class Predictive:
    """Turns what is passed at test time into a :class:`Prediction`, the way calibration data was read: ``kind`` is
    ``"probs"``, ``"logits"`` or ``"model"`` (then ``model`` predicts from inputs, with draws from ``generator``)."""

    def __init__(
        self, kind: str, num_classes: int, model: UncertainModel | None = None, generator: torch.Generator | None = None
    ) -> None:
        self.kind, self.num_classes, self.model, self.generator = kind, num_classes, model, generator

    def __call__(self, data: Any) -> Prediction:
        if isinstance(data, Prediction):
            self._check_classes(data.num_classes)
            return data
        if self.kind == "model":
            pred = self.model.predict(data, generator=self.generator)
            self._check_classes(pred.num_classes)
            return pred
        values = as_float_tensor(data, self.kind)
        self._check_classes(values.shape[1])
        is_probs = looks_like_probabilities(values)
        if self.kind == "probs" and not is_probs:
            raise InputError(
                "calibrated on probabilities, but these rows are not probabilities (entries outside "
                "[0, 1] or rows not summing to 1); pass probabilities, e.g. torch.softmax(logits, -1)"
            )
        if self.kind == "logits" and is_probs:
            raise InputError(
                "calibrated on logits, but these rows look like probabilities (in [0, 1], summing "
                "to 1); pass the model's logits as at calibration"
            )
        return Prediction.from_probs(values if self.kind == "probs" else torch.softmax(values, -1))

    def _check_classes(self, num_classes: int) -> None:
        if num_classes != self.num_classes:
            raise InputError(f"calibrated on {self.num_classes} classes, got predictions over {num_classes}")


def calibration_predictions(
    source: Any, labels: Any, *, inputs: str = "auto", progress: bool = True, seed: int = 0, desc: str = "calibrate"
) -> tuple[Predictive, Prediction, Tensor]:
    """The test-time :class:`Predictive`, the calibration :class:`Prediction` and its labels (see module docs).

    Example:
        >>> from posthoc.guarantees.sources import calibration_predictions
        >>> from posthoc_apps.demo.examples import um, calibration_loader
        >>> predictive, pred, labels = calibration_predictions(um, calibration_loader)
        >>> predictive.kind
        'model'
    """
    one_of(inputs, "inputs", INPUT_KINDS)
    if isinstance(source, UncertainModel):
        if inputs != "auto":
            raise ConfigError("inputs= describes arrays of probabilities or logits; leave it out for a wrapped model")
        if not looks_like_loader(labels):
            arrays = arrays_pair(labels) or isinstance(labels, (Tensor, np.ndarray))
            raise InputError(
                f"with a wrapped model, calibration takes a loader of (x, y) batches (a labelled calibration "
                f"loader: a DataLoader or a list of (x, y) pairs), not {type(labels).__name__} labels, e.g. "
                "posthoc.conformal(um, calibration_loader)"
                + (f"; wrap arrays x, y in a DataLoader: {loader_fix(labels)}" if arrays else "")
            )
        generator = torch.Generator(device=source.device).manual_seed(seed)
        pred, targets = predict_loader(source, labels, progress=progress, generator=generator, desc=desc)
        return Predictive("model", pred.num_classes, source, generator), pred, targets
    if isinstance(source, Prediction):
        return Predictive("probs", source.num_classes), source, as_labels(labels, source.num_classes, len(source))
    values = as_float_tensor(source, "calibration probabilities or logits")
    kind = inputs if inputs != "auto" else ("probs" if looks_like_probabilities(values) else "logits")
    predictive = Predictive(kind, values.shape[1])
    return predictive, predictive(values), as_labels(labels, values.shape[1], values.shape[0])


def prediction_type(source: Any) -> type:
    """The kind of prediction a guarantee is calibrated on: a wrapped model's likelihood's ``prediction_type``, a
    :class:`~posthoc.RegressionPrediction`'s own type, and :class:`~posthoc.Prediction` otherwise.

    Example:
        >>> from posthoc.guarantees.sources import prediction_type
        >>> import torch
        >>> prediction_type(torch.tensor([[0.2, 0.8]])).__name__
        'Prediction'
    """
    if isinstance(source, RegressionPrediction):
        return RegressionPrediction
    return source.likelihood.prediction_type if isinstance(source, UncertainModel) else Prediction


def is_regression(source: Any) -> bool:
    """Whether ``source`` is a :class:`RegressionPrediction` or a model wrapped with a regression likelihood.

    Example:
        >>> import posthoc
        >>> from posthoc.guarantees.sources import is_regression
        >>> from posthoc_apps.demo.examples import regressor
        >>> is_regression(posthoc.wrap(regressor, method="none", likelihood="regression"))
        True
    """
    return prediction_type(source) is RegressionPrediction
