"""DAC for a regressor: a per-example variance inflation from the k-NN feature distances, and its held-out NLL.

Under ``likelihood="regression"`` (or ``"heteroscedastic"``) the map of the standardised excess distances ``e_l(x)``
(:mod:`posthoc.methods.dac.temperature`), ``v(x) = V0 * (1 + sum_l w_l * e_l(x))``, multiplies the *variance* of the
inner predictive: its Gaussian mixture ``Y`` becomes ``mu + sqrt(v(x)) (Y - mu)``, so its mean stays and its variance
(and its aleatoric and epistemic parts) are multiplied by ``v(x)`` exactly. ``V0`` is the clean maximum-likelihood
variance scale (variance scaling, Kuleshov et al. 2018; 1 for the weighted candidates), and the weights are fitted
by the Gaussian mixture NLL as the temperature's are by the categorical one. The NLL of the inflated mixture needs
no new prediction: with ``s = sqrt(v)`` its density at ``y`` is the inner one's at ``mu + (y - mu) / s`` over ``s^D``.

Example:
    >>> import torch
    >>> from posthoc.methods.dac.variance import Spread
    >>> spread = Spread(torch.zeros(1, 3, 1), torch.ones(1, 3, 1), torch.zeros(3, 2), torch.tensor([[0.0], [1.0], [2.0]]))
    >>> spread.nlls(torch.ones(3)).round(decimals=4)
    tensor([0.9189, 1.4189, 2.9189])
    >>> bool(spread.nlls(torch.full((3,), 4.0))[2] < spread.nlls(torch.ones(3))[2])   # wider: the far target costs less
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.prediction import RegressionPrediction
from posthoc.methods.dac.temperature import LOG_T0_BOUND, temperatures


def inflated_nll(means: Tensor, variances: Tensor, targets: Tensor, factor: Tensor) -> Tensor:
    """The NLL ``(N,)`` of ``targets`` ``(N, D)`` under the mixture of equal weights of ``N(means_k, variances_k)``
    (each ``(K, N, D)``), its variance times ``factor`` ``(N,)`` about its mean; differentiable in ``factor``.
    """
    scale = factor.to(means.dtype).sqrt()[:, None]  # (N, 1)
    mean = means.mean(0)
    pulled = mean + (targets.to(means.dtype) - mean) / scale  # the target mapped back onto the inner mixture
    log_density = -0.5 * ((pulled - means).square() / variances + torch.log(2 * math.pi * variances)).sum(-1)  # (K, N)
    log_mixture = torch.logsumexp(log_density, dim=0) - math.log(means.shape[0])
    return -log_mixture + means.shape[-1] * scale[:, 0].log()


def inflated(prediction: RegressionPrediction, factor: Tensor) -> RegressionPrediction:
    """``prediction`` with example ``i``'s variance multiplied by ``factor[i]`` about its mean: every component's mean
    moves to ``mu + s (mu_k - mu)`` and its model and noise variances are times ``s² = factor``.

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import RegressionPrediction
        >>> from posthoc.methods.dac.variance import inflated
        >>> pred = RegressionPrediction.from_components(torch.zeros(1, 2, 1), None, torch.ones(1, 1, 1))
        >>> inflated(pred, torch.tensor([1.0, 4.0])).std
        tensor([[1.],
                [2.]])
    """
    factor = factor.to(device=prediction.mean.device, dtype=prediction.mean.dtype)
    scale = factor.sqrt()[None, :, None]
    means = prediction.mean + scale * (prediction.component_means - prediction.mean)
    return RegressionPrediction.from_components(
        means, factor[None, :, None] * prediction.model_variances, factor[None, :, None] * prediction.noise
    )


@dataclass
class Spread:
    """Cached held-out regression predictions, fitted as :class:`~posthoc.methods.dac.temperature.Cached` is: the inner
    mixture's component means and variances (model plus noise) ``(K, N, D)``, excess distances and targets."""

    means: Tensor
    variances: Tensor
    excess: Tensor
    targets: Tensor

    #: what ``V0`` scales, and why the clean examples may fail to determine it (for the fit's warning)
    scale_name = "variance scale"
    undetermined = "the predictive variance is far off the residuals"

    @property
    def values(self) -> Tensor:
        """The inner predictions (what sizes the fit)."""
        return self.means

    def double(self) -> Spread:
        """The same in float64 (the fit's precision)."""
        return Spread(self.means.double(), self.variances.double(), self.excess.double(), self.targets.double())

    def rows(self, index: Tensor) -> Spread:
        """The examples ``index``."""
        index = index.to(self.targets.device)
        return Spread(
            self.means.index_select(1, index),
            self.variances.index_select(1, index),
            self.excess[index],
            self.targets[index],
        )

    def nlls(self, factor: Tensor) -> Tensor:
        """Each example's NLL ``(N,)`` with its variance multiplied by ``factor`` ``(N,)``."""
        return inflated_nll(self.means, self.variances, self.targets, factor)

    def nll(self, log_t0: Tensor, weights: Tensor) -> Tensor:
        """Mean NLL of the targets with the variance multiplied by ``exp(log_t0) (1 + excess @ weights)``."""
        factor = temperatures(self.excess.to(weights), log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp(), weights)
        return self.nlls(factor).mean()
