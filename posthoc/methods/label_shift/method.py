"""``"label-shift"``: the inner predictive corrected for the deployment's class priors.

``p(y | x)`` of the inner method, calibrated on the held-out set (``calibration="bcts"``: a temperature and a bias
per class), is multiplied by ``w_y = q(y) / p(y)`` and renormalised, per posterior sample where there are samples.
``p`` is the held-out label frequency; ``q`` the deployment priors: given (``target_priors=``) or estimated from
unlabelled deployment data by :func:`posthoc.label_shift` (BBSE or EM, :mod:`~posthoc.methods.label_shift.estimate`),
which records the estimate here so that the corrected model saves, loads and exports like any other.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, val_loader, x
    >>> um = posthoc.wrap(model, method="label-shift", target_priors=[0.1, 0.1, 0.8]).fit(None, val_loader)
    >>> [round(p, 3) for p in um.method.summary()["target_priors"]]
    [0.1, 0.1, 0.8]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import one_of
from posthoc.core.inputs import Inputs, check_labels, iterate
from posthoc.core.logits import LOG_PROB_FLOOR, log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.errors import ConfigError
from posthoc.export.modules import FunctionMap
from posthoc.methods.label_shift.estimate import fit_bcts, shifted_log_probs, source_priors

ESTIMATORS = ("given", "bbse", "em")
CALIBRATIONS = ("bcts", "none")


def check_priors(priors: Any, classes: int | None = None) -> list[float]:
    """``priors`` as a list of positive floats summing to 1 (to 1e-6), of ``classes`` entries where known.

    Example:
        >>> from posthoc.methods.label_shift.method import check_priors
        >>> check_priors([0.2, 0.3, 0.4])
        Traceback (most recent call last):
        posthoc.errors.ConfigError: target_priors must be class probabilities that sum to 1...
    """
    try:
        values = [float(p) for p in priors]
    except (TypeError, ValueError) as err:
        raise ConfigError(f"target_priors must be a list of class probabilities, got {priors!r}") from err
    if not values or any(not p > 0 for p in values) or abs(sum(values) - 1) > 1e-6:
        raise ConfigError(
            f"target_priors must be class probabilities that sum to 1, each > 0 (a class of prior 0 is never "
            f"predicted); got {len(values)} values summing to {sum(values):.6g}, smallest {min(values, default=0):.3g}"
        )
    if classes is not None and len(values) != classes:
        raise ConfigError(f"target_priors has {len(values)} entries but the model predicts {classes} classes")
    return values


class Reweighted(nn.Module):
    """The exported form: :func:`shifted_log_probs` of the inner predictive module (per sample where it samples)."""

    def __init__(self, inner: nn.Module, shift: nn.Module) -> None:
        super().__init__()
        self.inner, self.shift = inner, shift

    def forward(self, x: Any) -> LogPredictive:
        return reweighted(self.shift, *self.inner(x))


def reweighted(shift: Any, log_probs: Tensor, samples: Tensor | None) -> LogPredictive:
    """``shift`` (log-probabilities to corrected ones) applied per sample when there are samples, else once."""
    if samples is not None:
        corrected = shift(samples.clamp_min(LOG_PROB_FLOOR))
        return log_mean_exp(corrected), corrected
    return shift(log_probs.clamp_min(LOG_PROB_FLOOR)), None


@register
class LabelShift(Method):
    """The inner predictive calibrated and reweighted by ``q(y) / p(y)`` (module docs)."""

    name = "label-shift"
    listed = False  # posthoc.label_shift builds it from the deployment data; method= takes it with target_priors
    needs_val = True
    stacks = True
    exports = ("classification",)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        target_priors: list[float] | None = option(
            None, "the deployment's class priors q (posthoc.label_shift estimates them from unlabelled data)"
        )
        estimator: str = option("given", "where target_priors came from: 'given', 'bbse' or 'em'")
        calibration: str = option("bcts", "'bcts': a temperature and a bias per class fitted first; or 'none'")

    def __init__(self, inner: Method, options: Options) -> None:
        super().__init__(inner.base_model)
        self.inner = inner
        #: the deployment's priors q (``None`` until given: fit then says how to get them)
        self.target = None if options.target_priors is None else check_priors(options.target_priors)
        self.estimator = one_of(options.estimator, "estimator", ESTIMATORS)
        self.calibration = one_of(options.calibration, "calibration", CALIBRATIONS)
        classes = 0 if self.target is None else len(self.target)
        self.register_buffer("temperature", torch.ones((), dtype=torch.float64))
        self.register_buffer("bias", torch.zeros(classes, dtype=torch.float64))
        self.register_buffer("source_priors", torch.full((classes,), 1 / max(classes, 1), dtype=torch.float64))

    @property
    def base_model(self) -> nn.Module:
        return self.inner.base_model

    @property
    def log_weights(self) -> Tensor:
        """``log q(y) - log p(y)`` per class."""
        target = torch.tensor(self.target, dtype=torch.float64, device=self.source_priors.device)
        return target.log() - self.source_priors.log()

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """The held-out label frequencies ``p`` and the calibration, from the inner predictive on ``val_loader``."""
        log_probs, labels = [], []
        with torch.no_grad(), eval_mode(self.inner):
            for x, y in iterate(val_loader, device=self.device, progress=progress, desc="label-shift"):
                part, _ = self.inner.log_predictive(x)
                log_probs.append(part.double())
                labels.append(check_labels(y, part.shape[-1]))
        self.fit_on(torch.cat(log_probs), torch.cat(labels))

    def fit_on(self, log_probs: Tensor, labels: Tensor) -> None:
        """Fit ``p`` and the calibration on held-out log-probabilities ``(N, C)`` and labels ``(N,)``."""
        if self.target is None:
            raise ConfigError(
                "'label-shift' needs target_priors=[...] (the deployment's class priors), or estimate them from "
                "unlabelled deployment data: posthoc.label_shift(um, val_loader, target_loader)"
            )
        check_priors(self.target, log_probs.shape[-1])
        self.source_priors = source_priors(labels, log_probs.shape[-1]).to(self.source_priors.device)
        if self.calibration == "bcts":
            temperature, bias = fit_bcts(log_probs.clamp_min(LOG_PROB_FLOOR), labels)
            self.temperature, self.bias = temperature.to(self.bias.device), bias.to(self.bias.device)
        self.fitted.fill_(True)

    def shift_map(self) -> FunctionMap:
        """The fitted correction as a module: log-probabilities to corrected log-probabilities."""
        return FunctionMap(
            shifted_log_probs, {"temperature": self.temperature, "bias": self.bias, "log_weights": self.log_weights}
        )

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator)
        log_weights = self.log_weights

        def shift(values: Tensor) -> Tensor:
            return shifted_log_probs(values, self.temperature, self.bias, log_weights)

        return reweighted(shift, log_probs, samples)

    def to_module(self, export: Any) -> nn.Module:
        return Reweighted(export.predictive(self.inner), self.shift_map())

    def summary(self) -> dict[str, Any]:
        """The priors (deployment ``q``, held-out ``p``), where ``q`` came from, and the calibration."""
        return {
            "random_variables": 0,
            "layers": [],
            "estimator": self.estimator,
            "target_priors": None if self.target is None else [round(p, 6) for p in self.target],
            "source_priors": [round(float(p), 6) for p in self.source_priors],
            "temperature": round(float(self.temperature), 6),
        }
