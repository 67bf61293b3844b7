"""``"vi"``: Bayes by Backprop from a checkpoint — a mean-field Gaussian over chosen layers, fitted by the ELBO.

The posterior ``q(w) = prod N(mu, sigma^2)`` covers the head by default (``layers="head"``), or
``layers="all"`` / module names; its means start at the checkpoint's weights and its standard
deviations at ``init_std`` times each layer's weight RMS (:mod:`posthoc.methods.vi.gaussian`). The
prior is ``N(0, s^2)`` or, with ``prior_mean="checkpoint"``, ``N(w_checkpoint, s^2)``. ``fit``
maximises the ELBO with one local-reparameterisation draw per example (Kingma et al. 2015) and
the KL weight annealed by ``kl_schedule`` (:mod:`posthoc.engine.kl_schedule`); the user's model
is never changed (:mod:`posthoc.engine.variational_method`).

Defaults: the head, ``init_std=0.2``, prior ``N(0, 1)``, 3 epochs with a linear KL warm-up. A smaller
``init_std`` leaves the standard deviations too small after 3 epochs; longer fits widen them past what
in-distribution NLL allows. Measured: docs/methods/vi.md.

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

from posthoc.core.registry import register
from posthoc.engine.variational_method import VariationalMethod
from posthoc.errors import ConfigError
from posthoc.methods.vi.gaussian import PRIOR_MEANS, GaussianLayer


@register
class VariationalInference(VariationalMethod):
    """Mean-field Gaussian VI (Bayes by Backprop) over chosen layers of a trained model (see module docs).

    Options:
        layers: ``"head"`` (default), ``"all"`` or module names.
        head: the head's module name where it cannot be found automatically.
        prior_std: ``s`` of the prior ``N(m, s^2)`` [1.0].
        prior_mean: ``"zero"`` (``m = 0``) or ``"checkpoint"`` (``m`` = the pretrained weights) ["zero"].
        init_std: initial standard deviation of every weight, as a fraction of its layer's weight RMS [0.2].
        num_samples: samples per prediction [20].
        seed: seeds the predictive's draws when ``predict`` gets no generator.

    Fit options: ``epochs`` [3]; ``lr`` (Adam, the means) [1e-3]; ``lr_scale`` (Adam, the log standard
    deviations) [1e-2]; ``kl_weight`` (the final KL weight; 1 is the ELBO) [1.0]; ``kl_schedule``
    (``"linear"``, ``"cosine"``, ``"cyclical"``, ``"constant"``) ["linear"]; ``kl_warmup`` (fraction of
    the steps, or of each cycle, over which the weight rises) [0.5]; ``kl_cycles`` (for ``"cyclical"``) [4].
    """

    name = "vi"

    @dataclass(frozen=True, kw_only=True)
    class Options(VariationalMethod.Options):
        layers: str | Sequence[str] = "head"
        head: str | None = None
        prior_std: float = 1.0
        prior_mean: Literal[PRIOR_MEANS] = "zero"
        init_std: float = 0.2
        num_samples: int = 20
        seed: int = 0

    def __init__(self, model: nn.Module, options: Options) -> None:
        layers, head, prior_std, prior_mean = options.layers, options.head, options.prior_std, options.prior_mean
        init_std, num_samples, seed = options.init_std, options.num_samples, options.seed
        for option, value in (("prior_std", prior_std), ("init_std", init_std)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{option} must be a finite number > 0, got {value!r}")
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
