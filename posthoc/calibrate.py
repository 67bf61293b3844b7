"""``posthoc.calibrate``: calibrating a deployed classifier from its saved logits alone.

Calibrators (see :mod:`posthoc.methods.calibration`): ``"temperature"`` (default), ``"vector"``,
``"matrix"`` (ODIR), ``"dirichlet"``, ``"ets"``, ``"histogram"``, ``"isotonic"``, ``"venn-abers"``, ``"platt"``
(binary), ``"none"`` (the model's own probabilities, as ``method="none"`` in ``posthoc.wrap``; ``"identity"`` is
another name for it), and ``"auto"`` (the others compared by k-fold cross-validated NLL, each flexible one against
the temperature it extends). A fit that keeps the model's own probabilities reads ``"none"`` in ``chosen_name``, in
its selection record and in its warning.

The default is ``"temperature"``, where ``posthoc.wrap`` and ``posthoc evaluate`` default to ``"auto"``: from logits
alone there is no network to put a posterior on, and one parameter fitted on the held-out rows (checked against the
plain model as ``um.fit`` checks it) is the calibrator that needs fewest examples; ``method="auto"`` compares them all.

Probabilities come back in the logits' type (numpy for numpy, a tensor for a tensor) and floating dtype (float64
for float64). A binary classifier's ``(N,)`` logits give ``(N, 2)`` probabilities, the positive class in column 1:
the same shape as every classifier's, so that a :class:`~posthoc.Prediction`, the metrics and ``posthoc.evaluate``
read them alike (``calibrator(z)[:, 1]`` is the positive class's probability). Every one is fitted
by the selection step of ``um.fit`` (:mod:`posthoc.engine.selection`); ``calibrator.selection`` records the choice.

A deployed **regressor** gives ``mean=``, ``std=`` (or none: a constant std) and ``targets=``; its calibrators:
``"variance-scaling"`` (the default; Levi et al. 2019), ``"isotonic"`` (the predictive CDF recalibrated, Kuleshov et
al. 2018), ``"identity"`` and ``"auto"`` (k-fold cross-validated CRPS). ``calibrator.predict(mean, std)`` gives a
calibrated :class:`~posthoc.RegressionPrediction`.

Example:
    >>> import torch
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_logits, val_labels, test_logits
    >>> calibrator = posthoc.calibrate(val_logits, val_labels, method="auto", tolerance=0.03)
    >>> calibrator.chosen_name, round(calibrator.scores["temperature"]["nll"], 3)    # cross-validated
    ('temperature', 0.463)
    >>> probs = calibrator(test_logits)
    >>> calibrator.save("calibrator.pt"); posthoc.calibrate.load("calibrator.pt").chosen_name
    'temperature'
    >>> posthoc.calibrate(val_logits, val_labels, method="auto").selection["chosen"]  # the default tolerance
    'temperature at 0.75'
    >>> mean, std = torch.randn(200), torch.full((200,), 2.0)     # a regressor's held-out predictions,
    >>> targets = mean + torch.randn(200)                         # whose stds are twice too wide
    >>> calibrator = posthoc.calibrate(mean=mean, std=std, targets=targets, method="isotonic")
    >>> lower, upper = calibrator.predict(mean, std).interval(0.9)
    >>> round(float(((lower <= targets[:, None]) & (targets[:, None] <= upper)).float().mean()), 3)
    0.9
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from posthoc.core import persistence
from posthoc.core.checks import known_name, positive_int
from posthoc.core.inputs import as_tensor
from posthoc.core.logits import check_finite_logits, check_not_probabilities
from posthoc.engine.selection import Tolerance
from posthoc.errors import ConfigError, InputError, PosteriorFileError
from posthoc.methods.calibration import Calibrator, calibrators
from posthoc.methods.calibration.auto import regression_calibrators
from posthoc.methods.calibration.base import KIND, RegressionCalibrator, as_prediction, held_out_logits
from posthoc.methods.calibration.method import fit_on_logits
from posthoc.methods.calibration.options import IDENTITY, PLAIN


def calibrate(
    logits: Any = None,
    labels: Any = None,
    method: str | None = None,
    *,
    max_iter: int = 100,
    tolerance: Tolerance | float | None = None,
    mean: Any = None,
    std: Any = None,
    targets: Any = None,
    **options: Any,
) -> Calibrator | RegressionCalibrator:
    """Fit a calibrator on held-out ``logits`` ``(N, C)`` (or ``(N,)`` for binary) and ``labels`` ``(N,)``;
    or, for a regressor, on held-out ``mean``, ``std`` and ``targets`` (see the module docs).

    Args:
        logits: the classifier's held-out logits, a tensor or numpy array (the calibrator then gives numpy for numpy).
        method: the calibrator (see the module docs). ``None``: ``"temperature"``, or ``"variance-scaling"`` for a
            regressor.
        max_iter: L-BFGS iterations for the calibrators fitted by optimisation.
        tolerance: the held-out NLL a calibrator may cost over the model's own probabilities, judged as in
            ``um.fit``: ``None`` is the default :class:`~posthoc.engine.selection.Tolerance`, a number is nats per
            example, ``math.inf`` takes the clean maximum-likelihood fit, as netcal and torch-uncertainty do.
        **options: the calibrator's options, e.g. ``bins=10`` (histogram) or ``folds=5`` (auto).

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import val_logits, val_labels, test_logits
        >>> calibrator = posthoc.calibrate(val_logits.numpy(), val_labels.numpy())   # numpy arrays work too
        >>> calibrator(test_logits.numpy()).sum(-1)[:3].round(4)   # numpy in, numpy out; rows sum to 1
        array([1., 1., 1.], dtype=float32)
        >>> calibrator(test_logits.double()).sum(-1)[:3].round(decimals=4)   # a tensor for a tensor, float64 kept
        tensor([1., 1., 1.], dtype=torch.float64)
    """
    if mean is not None or targets is not None or std is not None:
        return _calibrate_regressor(logits, labels, method, mean, std, targets, options, tolerance)
    if logits is None or labels is None:
        raise InputError(
            "calibrate needs held-out logits and labels (a classifier), or mean=, std= and targets= (a regressor)"
        )
    method = "temperature" if method is None else (IDENTITY if method == PLAIN else method)
    if method in ("variance-scaling",):
        raise ConfigError(f"'{method}' calibrates a regressor: pass mean=, std= and targets= (not logits and labels)")
    cls = calibrators()[known_name(method, "calibration method", [PLAIN, *calibrators()])]
    chosen = cls.Options.make(options, f"calibrator '{method}'")
    positive_int(max_iter, "max_iter")
    if "max_iter" in cls.option_defaults():
        chosen = dataclasses.replace(chosen, max_iter=max_iter)
    logits = as_tensor(logits, "logits")
    class_logits, targets = held_out_logits(logits, labels, samples=False)
    check_finite_logits(logits)
    check_not_probabilities(logits)
    if method == "auto":  # it chooses among calibrators by the same selection step
        if isinstance(tolerance, Tolerance):
            raise ConfigError("calibrate(method='auto') takes tolerance= as nats per example (a number) or None")
        chosen = dataclasses.replace(chosen, tolerance=tolerance)
    calibrator = cls(**chosen.as_dict())
    if method in (IDENTITY, "auto"):  # nothing to choose / its own choice by the same selection step
        return calibrator.fit(class_logits.float(), targets)
    return fit_on_logits(calibrator, class_logits.float(), targets, tolerance=Tolerance.of(tolerance))


def _calibrate_regressor(
    logits: Any,
    labels: Any,
    method: str | None,
    mean: Any,
    std: Any,
    targets: Any,
    options: dict[str, Any],
    tolerance: Tolerance | float | None = None,
) -> RegressionCalibrator:
    """``calibrate`` for a regressor's ``mean``, ``std`` (or none) and ``targets``."""
    if logits is not None or labels is not None:
        raise InputError(
            "calibrate got logits/labels and mean/std/targets: pass logits and labels for a classifier, "
            "or mean=, std= and targets= for a regressor"
        )
    if mean is None or targets is None:
        raise InputError("calibrating a regressor needs mean= and targets= (and std= if it predicts one)")
    method = "variance-scaling" if method is None else (IDENTITY if method == PLAIN else method)
    known = regression_calibrators()
    if method not in known and method in calibrators():
        raise ConfigError(
            f"'{method}' calibrates a classifier's logits, not a regressor; for mean/std/targets use one "
            f"of {sorted(known)}"
        )
    cls = known[known_name(method, "regression calibration method", known)]
    chosen = cls.Options.make(options, f"regression calibrator '{method}'")
    if method == "auto":  # its choice by the selection step, on CRPS: a number is in the target's units
        if isinstance(tolerance, Tolerance):
            raise ConfigError("calibrate(method='auto') takes tolerance= as a number (the target's units) or None")
        chosen = dataclasses.replace(chosen, tolerance=tolerance)
    prediction = as_prediction(mean, std)
    y = as_tensor(targets, "targets")
    if y.shape[0] != prediction.mean.shape[0]:
        raise InputError(
            f"mean and targets have different lengths ({prediction.mean.shape[0]} vs {y.shape[0]}); "
            "pass one target per prediction"
        )
    calibrator = cls(**chosen.as_dict())
    calibrator.unit_std.fill_(std is None)
    return calibrator.fit(prediction, y)


def load_calibrator(path: str | os.PathLike) -> Calibrator | RegressionCalibrator:
    """Read a calibrator saved with ``calibrator.save(path)``; it refuses logits with another number of classes.

    Example:
        >>> import torch
        >>> import posthoc
        >>> from posthoc.calibrate import load_calibrator
        >>> from posthoc_apps.demo.examples import logits, labels, test_logits
        >>> posthoc.calibrate(logits, labels).save("t.pt")
        >>> load_calibrator("t.pt")(torch.zeros(2, 5))
        Traceback (most recent call last):
        posthoc.errors.InputError: ...
    """
    payload = persistence.read(path, kind="calibrator")
    entry = payload["spec"][0]
    entry = {**entry, "name": IDENTITY if entry["name"] == PLAIN else entry["name"]}
    known = regression_calibrators() if entry.get("kind") == KIND else calibrators()
    if entry["name"] not in known:
        raise PosteriorFileError(f"{path} names an unknown calibrator {entry['name']!r}")
    try:
        calibrator = known[entry["name"]](**entry["options"])
    except (TypeError, ConfigError) as err:
        raise PosteriorFileError(
            f"{path} holds options this posthoc cannot build '{entry['name']}' with: {err}"
        ) from err
    calibrator.load_buffers(payload["state"], source=str(path))
    return calibrator


calibrate.load = load_calibrator  # type: ignore[attr-defined]
