"""The mean-field Gaussian posterior of one layer, and its KL divergence from a Gaussian prior.

Every weight (and bias) has its own ``N(mu, sigma^2)``: ``mu`` starts at the checkpoint's value, ``sigma`` at
``init_std`` times the layer's weight RMS (the same fraction of the weights' scale in every layer). The prior is
``N(m, s^2)`` per weight, ``m`` zero or the checkpoint's value (read from the user's layer, which is never changed).

Example:
    >>> from torch import nn
    >>> from posthoc.methods.vi.gaussian import GaussianLayer
    >>> posterior = GaussianLayer(nn.Linear(4, 3), init_std=0.2, prior_std=1.0, prior_mean="zero")
    >>> posterior.kl().shape
    torch.Size([])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posthoc.engine.variational_layers import LayerPosterior, Moments
from posthoc.errors import ConfigError

PRIOR_MEANS = ("zero", "checkpoint")


def gaussian_kl(mean: Tensor, log_std: Tensor, prior_mean: Tensor | float, prior_std: float) -> Tensor:
    """``sum KL(N(mean, exp(log_std)^2) || N(prior_mean, prior_std^2))`` over all elements.

    Example:
        >>> import torch
        >>> from posthoc.methods.vi.gaussian import gaussian_kl
        >>> float(gaussian_kl(torch.zeros(3), torch.zeros(3), 0.0, 1.0))
        0.0
    """
    variance_ratio = torch.exp(2 * log_std) / prior_std**2
    return 0.5 * (variance_ratio + (mean - prior_mean) ** 2 / prior_std**2 - 1 - torch.log(variance_ratio)).sum()


class GaussianLayer(LayerPosterior):
    """``N(mu, sigma^2)`` for each weight and bias of ``layer`` (see module docs)."""

    def __init__(self, layer: nn.Module, *, init_std: float, prior_std: float, prior_mean: str) -> None:
        super().__init__(layer)
        if prior_mean not in PRIOR_MEANS:
            raise ConfigError(f"prior_mean must be one of {PRIOR_MEANS}, got {prior_mean!r}")
        self.prior_std, self.prior_mean = float(prior_std), prior_mean
        weight = layer.weight.detach().float()
        rms = float(weight.pow(2).mean().sqrt())
        log_std = math.log(init_std * (rms if rms > 0 else 1.0))
        self.weight_mean = nn.Parameter(weight.clone())
        self.weight_log_std = nn.Parameter(torch.full_like(weight, log_std))
        self.bias_mean = self.bias_log_std = None
        if layer.bias is not None:
            self.bias_mean = nn.Parameter(layer.bias.detach().float().clone())
            self.bias_log_std = nn.Parameter(torch.full_like(self.bias_mean, log_std))

    def moments(self) -> Moments:
        bias_var = None if self.bias_log_std is None else torch.exp(2 * self.bias_log_std)
        return self.weight_mean, torch.exp(2 * self.weight_log_std), self.bias_mean, bias_var

    def _prior_mean(self, checkpoint: Tensor) -> Tensor | float:
        return checkpoint.detach().float() if self.prior_mean == "checkpoint" else 0.0

    def kl(self) -> Tensor:
        kl = gaussian_kl(self.weight_mean, self.weight_log_std, self._prior_mean(self.layer.weight), self.prior_std)
        if self.bias_mean is not None:
            kl = kl + gaussian_kl(self.bias_mean, self.bias_log_std, self._prior_mean(self.layer.bias), self.prior_std)
        return kl

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        locations = [p for p in (self.weight_mean, self.bias_mean) if p is not None]
        scales = [p for p in (self.weight_log_std, self.bias_log_std) if p is not None]
        return locations, scales
