"""Sparse variational dropout's posterior of one layer (Molchanov, Ashukha and Vetrov, ICML 2017).

Each weight is ``w ~ N(theta, alpha theta^2)`` under the log-uniform prior ``p(|w|) ∝ 1 / |w|``, parameterised by
``theta`` and ``log sigma^2`` (the paper's additive reparameterisation, so the gradient's variance does not grow with
``alpha``). The KL divergence has no closed form; the paper's approximation (eq. 14, within about 0.01 nats) is

    -KL ≈ k1 * sigmoid(k2 + k3 * log alpha) - 0.5 * log(1 + 1/alpha) - k1,
    k1 = 0.63576, k2 = 1.87320, k3 = 1.48695,

which goes to 0 as ``alpha -> inf``: pure noise costs nothing, so the KL drives useless weights there. The bias stays
a point value, as in the paper.

Example:
    >>> from torch import nn
    >>> from posthoc.methods.sparse_vd.log_alpha import LogAlphaLayer
    >>> posterior = LogAlphaLayer(nn.Linear(4, 3), init_log_alpha=-4.0)
    >>> bool((posterior.log_alpha() - (-4.0)).abs().max() < 1e-4)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.engine.variational_layers import LayerPosterior, Moments

#: the constants of Molchanov et al. (2017), eq. 14
K1, K2, K3 = 0.63576, 1.87320, 1.48695
#: log alpha is clipped to this range (the authors' code), for the KL and for pruning
LOG_ALPHA_RANGE = (-10.0, 10.0)
#: keeps log theta^2 finite for a weight that is exactly zero
THETA_FLOOR = 1e-16


def kl_approximation(log_alpha: Tensor) -> Tensor:
    """Molchanov et al.'s approximation of ``KL(q(w) || p(w))`` per weight, as a function of ``log alpha``.

    Example:
        >>> import torch
        >>> from posthoc.methods.sparse_vd.log_alpha import kl_approximation
        >>> kl_approximation(torch.tensor([20.0])) < 1e-3      # pure noise costs nothing
        tensor([True])
    """
    return K1 - K1 * torch.sigmoid(K2 + K3 * log_alpha) + 0.5 * F.softplus(-log_alpha)


class LogAlphaLayer(LayerPosterior):
    """``N(theta, sigma^2)`` per weight with the log-uniform prior (see module docs)."""

    def __init__(self, layer: nn.Module, *, init_log_alpha: float) -> None:
        super().__init__(layer)
        theta = layer.weight.detach().float().clone()
        self.theta = nn.Parameter(theta)
        self.log_sigma2 = nn.Parameter(torch.log(theta * theta + THETA_FLOOR) + float(init_log_alpha))
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float().clone())
        #: weights removed from the posterior (mean and variance zero) while set; see ``pruning.restricted``
        self.removed: Tensor | None = None

    def log_alpha(self) -> Tensor:
        """``log sigma^2 - log theta^2``, clipped to ``LOG_ALPHA_RANGE``."""
        return (self.log_sigma2 - torch.log(self.theta * self.theta + THETA_FLOOR)).clamp(*LOG_ALPHA_RANGE)

    def moments(self) -> Moments:
        theta, variance = self.theta, torch.exp(self.log_sigma2)
        if self.removed is not None:
            theta, variance = theta.masked_fill(self.removed, 0.0), variance.masked_fill(self.removed, 0.0)
        return theta, variance, self.bias, None

    def kl(self) -> Tensor:
        return kl_approximation(self.log_alpha()).sum()

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [p for p in (self.theta, self.bias) if p is not None], [self.log_sigma2]
