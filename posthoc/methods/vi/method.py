"""``"vi"``: Bayes by Backprop from a checkpoint — a mean-field Gaussian over chosen layers, fitted by the ELBO.

The posterior ``q(w) = prod N(mu, sigma^2)`` over the chosen layers starts at the checkpoint's weights, its standard
deviations at ``init_std`` times each layer's weight RMS (:mod:`posthoc.methods.vi.gaussian`). ``fit`` maximises the
ELBO with one local-reparameterisation draw per example (Kingma et al. 2015) and the KL weight annealed by
``kl_schedule`` (:mod:`posthoc.engine.kl_schedule`); the user's model is never changed
(:mod:`posthoc.engine.variational_method`). The defaults are chosen in docs/methods/vi.md.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="vi").fit(train_loader, kl_schedule="cosine")
    >>> um.predict(x).samples.shape
    torch.Size([20, 8, 3])
    >>> posthoc.wrap(model, method="vi", layers="all", prior_mean="checkpoint").methods
    ['vi']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.variational_method import VariationalMethod
from posthoc.errors import ConfigError
from posthoc.methods.vi.gaussian import PRIOR_MEANS, GaussianLayer


@register
class VariationalInference(VariationalMethod):
    """Mean-field Gaussian VI (Bayes by Backprop) over chosen layers of a trained model (see module docs)."""

    name = "vi"

    @dataclass(frozen=True, kw_only=True)
    class Options(VariationalMethod.Options):
        layers: str | Sequence[str] = option("head", "head, all, or module names")
        head: str | None = option(None, "the head's module name where it cannot be found automatically")
        prior_std: float = option(1.0, "s of the prior N(m, s^2)")
        prior_mean: Literal[PRIOR_MEANS] = option("zero", "m = 0, or m = the checkpoint's weights")
        init_std: float = option(0.2, "every weight's initial std, as a fraction of its layer's weight RMS")
        num_samples: int = option(20, "samples per prediction")
        seed: int = option(0, "seeds the predictive's draws when predict gets no generator")

    def __init__(self, model: nn.Module, options: Options) -> None:
        layers, head, prior_std, prior_mean = options.layers, options.head, options.prior_std, options.prior_mean
        init_std, num_samples, seed = options.init_std, options.num_samples, options.seed
        for name, value in (("prior_std", prior_std), ("init_std", init_std)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        self.prior_std, self.prior_mean, self.init_std = float(prior_std), prior_mean, float(init_std)
        super().__init__(model, layers=layers, head=head, num_samples=num_samples, seed=seed)

    def _posterior(self, layer: nn.Module) -> GaussianLayer:
        return GaussianLayer(layer, init_std=self.init_std, prior_std=self.prior_std, prior_mean=self.prior_mean)

    def summary(self) -> dict[str, Any]:
        """The common card (:meth:`VariationalMethod.summary`) with the prior and the initial spread."""
        return {
            **super().summary(),
            "prior_std": self.prior_std,
            "prior_mean": self.prior_mean,
            "init_std": self.init_std,
        }
