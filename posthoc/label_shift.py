"""``posthoc.label_shift``: correct a fitted model for the class priors of its deployment, from unlabelled data.

Under label shift the inputs of each class look the same in deployment as in training, and only how often each class
occurs moves, from ``p`` to ``q``. ``posthoc.label_shift(um, val_loader, target_loader)`` estimates ``q`` from the
model's predictions on the deployment's unlabelled inputs and returns the model corrected for it: its predictive
``p(y | x)``, calibrated on the held-out set, times ``q(y) / p(y)``, renormalised. The result is an
:class:`~posthoc.UncertainModel` (method ``"label-shift"`` stacked on ``um``'s): it predicts, evaluates
(``posthoc.evaluate``), saves and exports (``to_module()``) like any other. ``estimator``:

- ``"em"`` (default): EM on the predictive calibrated by bias-corrected temperature scaling (Alexandari et al. 2020);
- ``"bbse"``: black-box shift estimation, the held-out confusion matrix inverted (Lipton et al. 2018).

A deployed classifier with saved logits only gives them instead of a model and loaders:
``posthoc.label_shift(logits=val_logits, labels=val_labels, target_logits=target_logits)``; the result then takes
logits as its inputs.

Example:
    >>> import posthoc, torch
    >>> from posthoc_apps.demo.examples import model, val_loader
    >>> um = posthoc.wrap(model, method="none")
    >>> x, _ = val_loader.dataset.tensors
    >>> target = torch.utils.data.DataLoader(x[:64], batch_size=32)       # unlabelled deployment inputs
    >>> shifted = posthoc.label_shift(um, val_loader, target, estimator="em")
    >>> shifted.methods, len(shifted.method.summary()["target_priors"])
    (['none', 'label-shift'], 3)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.api import wrap
from posthoc.core.checks import one_of
from posthoc.core.inputs import as_tensor, check_labels, iterate
from posthoc.core.likelihood import Categorical
from posthoc.core.logits import LOG_PROB_FLOOR
from posthoc.engine.uncertain_model import UncertainModel, check_wrapped
from posthoc.errors import ConfigError, InputError
from posthoc.methods.label_shift.estimate import bbse_priors, em_priors, shifted_log_probs
from posthoc.methods.label_shift.method import LabelShift

ESTIMATORS = ("em", "bbse")


def label_shift(
    um: UncertainModel | None = None,
    val_loader: Iterable | None = None,
    target_loader: Iterable | None = None,
    *,
    estimator: str = "em",
    calibration: str = "bcts",
    logits: Any = None,
    labels: Any = None,
    target_logits: Any = None,
    progress: bool = True,
) -> UncertainModel:
    """``um`` corrected for the class priors of ``target_loader``'s inputs (module docs).

    Args:
        um: a fitted classifier (``posthoc.wrap(model, ...).fit(...)``).
        val_loader: labelled held-out data from the training distribution (the priors ``p`` and the calibration).
        target_loader: deployment inputs (labels, if the batches carry them, are checked and not used).
        estimator: ``"em"`` or ``"bbse"``.
        calibration: ``"bcts"`` (a temperature and a bias per class, fitted on ``val_loader``) or ``"none"``.
        logits, labels, target_logits: a deployed classifier's held-out logits and labels and its deployment
            logits, instead of ``um`` and the loaders.

    Example:
        >>> import posthoc, torch
        >>> logits = 3 * torch.randn(6000, 3)                     # a classifier's logits and labels
        >>> labels = torch.distributions.Categorical(logits=logits).sample()
        >>> keep = (labels == 0) | (torch.rand(6000) < 0.2)       # deployment: class 0 five times as common
        >>> held_out, deployed = slice(0, 3000), keep & (torch.arange(6000) >= 3000)
        >>> shifted = posthoc.label_shift(logits=logits[held_out], labels=labels[held_out],
        ...                               target_logits=logits[deployed], progress=False)
        >>> round(shifted.method.summary()["target_priors"][0], 1)         # q(0): 1 / (1 + 0.2 + 0.2)
        0.7
        >>> shifted.predict(logits[deployed]).probs.shape                  # its inputs are logits
        torch.Size([..., 3])
    """
    estimator = one_of(estimator, "estimator", ESTIMATORS)
    if logits is not None or labels is not None or target_logits is not None:
        if um is not None or val_loader is not None or target_loader is not None:
            raise InputError(
                "label_shift takes um, val_loader and target_loader, or logits=, labels= and target_logits=, not both"
            )
        return _from_logits(logits, labels, target_logits, estimator, calibration, progress)
    um = check_wrapped(um, "posthoc.label_shift")
    if not isinstance(um.likelihood, Categorical):
        raise ConfigError("posthoc.label_shift corrects a classifier's class priors; this model is a regressor")
    if val_loader is None or target_loader is None:
        raise InputError(
            "posthoc.label_shift needs val_loader (labelled held-out data) and target_loader (the deployment's inputs)"
        )
    if not um.is_fitted:
        raise ConfigError("fit the model first (um.fit(...)); posthoc.label_shift corrects a fitted predictive")
    val_log_probs, val_labels = _log_predictive(um, val_loader, labelled=True, progress=progress)
    target_log_probs, _ = _log_predictive(
        um, target_loader, labelled=False, progress=progress, classes=val_log_probs.shape[-1], like=val_labels
    )
    return _corrected(um, val_log_probs, val_labels, target_log_probs, estimator, calibration)


def _log_predictive(
    um: UncertainModel,
    loader: Iterable,
    *,
    labelled: bool,
    progress: bool,
    classes: int | None = None,
    like: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``um``'s predictive log-probabilities over ``loader`` (and its labels, checked)."""
    what = "val_loader" if labelled else "target_loader"
    parts, labels = [], []
    for x, y in iterate(
        loader, device=um.device, progress=progress, desc=f"label shift: {what}", require_labels=labelled
    ):
        log_probs = um.predict(x, keep_samples=False).probs.clamp_min(1e-300).log().double().cpu()
        if classes is not None and log_probs.shape[-1] != classes:
            raise InputError(f"{what} gives {log_probs.shape[-1]} classes, the held-out data {classes}")
        parts.append(log_probs)
        if y is not None:
            if like is not None and y.dim() != like.dim():
                raise InputError(
                    f"{what}'s labels have shape {tuple(y.shape)}, unlike the held-out labels (one class index per "
                    "example): give the deployment inputs alone, or labels of the same kind"
                )
            labels.append(check_labels(y, log_probs.shape[-1], where=f" ({what})").cpu())
    return torch.cat(parts), (torch.cat(labels) if labels else None)


def _corrected(
    um: UncertainModel,
    val_log_probs: Tensor,
    val_labels: Tensor,
    target_log_probs: Tensor,
    estimator: str,
    calibration: str,
) -> UncertainModel:
    """``um`` with the ``"label-shift"`` stage whose ``q`` is estimated from the log-probabilities given."""
    classes = val_log_probs.shape[-1]
    # p and the calibration first, with uniform priors standing in for q
    method = LabelShift.build(um.method, target_priors=[1 / classes] * classes, calibration=calibration)
    method.fit_on(val_log_probs, val_labels)
    if estimator == "bbse":
        priors = bbse_priors(val_log_probs, val_labels, target_log_probs)
    else:
        calibrated = shifted_log_probs(
            target_log_probs.clamp_min(LOG_PROB_FLOOR), method.temperature, method.bias, torch.zeros(classes)
        )
        priors = em_priors(calibrated, method.source_priors)
    priors = priors.clamp_min(1e-12)
    options = {"target_priors": (priors / priors.sum()).tolist(), "estimator": estimator, "calibration": calibration}
    fitted = LabelShift.build(um.method, **options)
    fitted.load_posterior_state(
        {key: method.posterior_state()[key] for key in ("temperature", "bias", "source_priors")}
    )
    fitted.fitted.fill_(True)
    corrected = UncertainModel(fitted, [*um.spec, {"name": LabelShift.name, "options": options}], um.fingerprint)
    corrected.fit_record = um.fit_record
    return corrected


def _from_logits(
    logits: Any, labels: Any, target_logits: Any, estimator: str, calibration: str, progress: bool
) -> UncertainModel:
    """The correction of a deployed classifier's logits: a model whose inputs are its logits."""
    if logits is None or labels is None or target_logits is None:
        raise InputError("label_shift from logits needs logits= and labels= (held-out) and target_logits=")
    val = as_tensor(logits, "logits").float()
    target = as_tensor(target_logits, "target_logits").float()
    if val.dim() != 2 or target.dim() != 2 or val.shape[-1] != target.shape[-1]:
        raise InputError(
            f"logits and target_logits must be (N, C) with the same C, got {tuple(val.shape)} and {tuple(target.shape)}"
        )
    y = check_labels(as_tensor(labels, "labels", numbers=True), val.shape[-1], where=" (labels)")
    if len(y) != len(val):
        raise InputError(f"logits and labels have different lengths ({len(val)} vs {len(y)})")
    um = wrap(nn.Identity(), method="none")
    return _corrected(um, val.log_softmax(-1).double(), y, target.log_softmax(-1).double(), estimator, calibration)
