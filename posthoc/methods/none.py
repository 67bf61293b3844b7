"""``"none"``: the model's own softmax, the plain (MAP) model: the reference row of every table.

Under ``likelihood="regression"`` it is the model's output with the fitted observation noise,
``N(f(x), σ²)``, ``σ`` by maximum likelihood on the held-out residuals (the training residuals when
``fit`` gets no ``val_loader``), one ``σ_d`` per output of a multi-output model; under ``"heteroscedastic"``, the model's own mean and variance.

Example:
    >>> um = posthoc.wrap(model, method="none")
    >>> um.predict(x).samples is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from posthoc.core.inputs import Inputs, run_model
from posthoc.core.likelihood import (
    Categorical,
    Gaussian,
    HeteroscedasticGaussian,
    fit_noise_on,
    model_outputs,
)
from posthoc.core.logits import class_log_probs
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.registry import register
from posthoc.core.regression_prediction import RegressionPrediction


@register
class PlainModel(Method):
    """The trained model as it is: ``softmax(model(x))`` (regression: its output and a fitted noise). Needs no fit."""

    name = "none"
    requires_fit = False
    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)
    per_output_noise = True

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Fit the likelihood's observation noise, where it has one (classification: nothing to fit)."""
        with eval_mode(self.model):
            fit_noise_on(
                self.likelihood,
                (train_loader, val_loader),
                self.device,
                lambda x: (model_outputs(run_model(self.model, x))[None], None),
                progress=progress,
                per_output=True,
            )
        super().fit(train_loader, val_loader, progress=progress)

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        return class_log_probs(run_model(self.model, x)), None

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        return self.likelihood.predictive(model_outputs(run_model(self.model, x))[None])
