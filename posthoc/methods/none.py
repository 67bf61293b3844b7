"""``"none"``: the model's own softmax, the plain (MAP) model: the reference row of every table.

Under ``likelihood="regression"`` it is ``N(f(x), σ²)``, ``σ`` by maximum likelihood on the held-out residuals (the
training residuals without a ``val_loader``), one per output; under ``"heteroscedastic"``, the model's own variance.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, x
    >>> um = posthoc.wrap(model, method="none")
    >>> um.predict(x).samples is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from posthoc.core.inputs import Inputs, run_model
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian, fit_noise_on, model_outputs
from posthoc.core.logits import class_log_probs
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.feature_store import plain_output
from posthoc.export.modules import GaussianOutputs, Plain, observation_variance


@register
class PlainModel(Method):
    """The trained model as it is: ``softmax(model(x))`` (regression: its output and a fitted noise). Needs no fit."""

    name = "none"
    requires_fit = False
    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)
    per_output_noise = True
    exports = ("classification", "regression")

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Fit the likelihood's observation noise on the training residuals when there is no ``val_loader`` (with one,
        :meth:`choose` fits it on the held-out data; classification: nothing to fit)."""
        if val_loader is None:
            self._fit_noise((train_loader, None), progress)
        super().fit(train_loader, val_loader, progress=progress)

    def knob(self) -> Knob | None:
        """A noise fitted on held-out data is a held-out choice: ``um.choose(new_val_loader)`` fits it again. Its own
        ``choose``: a maximum-likelihood fit on the held-out batches (one per output), not a walk over candidates."""
        if not (self.likelihood.fits_noise and not self.likelihood.fixed):
            return None
        return Knob(
            name="noise", choose=lambda held_out, _, progress: self._fit_noise((None, list(held_out.clean())), progress)
        )

    def _fit_noise(self, loaders: tuple[Iterable | None, Iterable | None], progress: bool) -> None:
        with eval_mode(self.model):
            fit_noise_on(
                self.likelihood,
                loaders,
                self.device,
                lambda x: (model_outputs(run_model(self.model, x))[None], None),
                progress=progress,
                per_output=True,
            )

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        return class_log_probs(plain_output(self.model, x)), None

    def to_module(self, export: Any) -> nn.Module:
        """The network's softmax (regression: its outputs and the fitted noise), read from the exported network."""
        backbone = export.backbone(self.model)
        if export.regression:
            return GaussianOutputs(backbone, observation_variance(self.likelihood))
        return Plain(backbone)

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        return self.likelihood.predictive(model_outputs(run_model(self.model, x))[None])
