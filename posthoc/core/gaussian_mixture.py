"""Equal-weight mixtures of Gaussians, per output: the exact maths of a regression predictive.

A regression predictive of ``K`` components (one for a Laplace or plain-model predictive; one per
sample or member for MC dropout, the samplers and ensembles) is given by ``means`` and ``stds`` of
shape ``(K, N, D)``: example ``n``, output ``d`` has the density ``1/K sum_k N(y; mu_k, sigma_k^2)``.
Outputs are independent. Everything here is exact for such mixtures (the quantile up to the
bisection's float64 resolution); nothing samples.

Example:
    >>> means, stds = torch.tensor([[[0.0]], [[2.0]]]), torch.ones(2, 1, 1)
    >>> round(float(cdf(means, stds, torch.tensor([[1.0]]))), 6)       # symmetric about 1
    0.5
    >>> round(float(quantile(means, stds, 0.5)), 6)
    1.0
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.core.errors import InputError

#: bisection steps of :func:`quantile`: halves a bracket of width ``w`` down to ``w * 2**-64``
BISECTION_STEPS = 64


def _normal_cdf(z: Tensor) -> Tensor:
    return 0.5 * torch.erfc(-z / math.sqrt(2.0))


def _normal_pdf(z: Tensor) -> Tensor:
    return torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def check_components(means: Tensor, stds: Tensor) -> tuple[Tensor, Tensor]:
    """``means`` and ``stds`` as float64 ``(K, N, D)`` tensors, refusing shapes that differ or stds <= 0."""
    if means.shape != stds.shape or means.dim() != 3:
        raise InputError(f"mixture components must be (K, N, D) means and stds of one shape; got {tuple(means.shape)} "
                         f"and {tuple(stds.shape)}")
    if not bool((stds > 0).all()):
        raise InputError("every component's std must be > 0; a regression predictive needs a fitted observation noise")
    return means.double(), stds.double()


def log_prob(means: Tensor, stds: Tensor, y: Tensor) -> Tensor:
    """Log-density of ``y (N, D)`` under the mixture, ``(N, D)``, by a log-sum-exp over the components."""
    means, stds = check_components(means, stds)
    z = (y.double() - means) / stds
    component = -0.5 * z * z - stds.log() - 0.5 * math.log(2.0 * math.pi)
    return torch.logsumexp(component, dim=0) - math.log(means.shape[0])


def cdf(means: Tensor, stds: Tensor, y: Tensor) -> Tensor:
    """``P(Y <= y)`` under the mixture, ``(N, D)``: the mean of the components' CDFs."""
    means, stds = check_components(means, stds)
    return _normal_cdf((y.double() - means) / stds).mean(0)


def quantile(means: Tensor, stds: Tensor, q: float) -> Tensor:
    """The ``q``-quantile ``(N, D)``: closed form for one component, else bisection on :func:`cdf`.

    The mixture's quantile lies between the smallest and the largest of its components' quantiles,
    which bracket the bisection.
    """
    if not 0.0 < q < 1.0:
        raise InputError(f"a quantile level must be strictly between 0 and 1, got {q!r}")
    means, stds = check_components(means, stds)
    z = math.sqrt(2.0) * torch.erfinv(torch.tensor(2.0 * q - 1.0, dtype=torch.float64))
    component_quantiles = means + stds * z
    if means.shape[0] == 1:
        return component_quantiles[0]
    low, high = component_quantiles.min(0).values, component_quantiles.max(0).values
    for _ in range(BISECTION_STEPS):
        middle = 0.5 * (low + high)
        below = _normal_cdf((middle - means) / stds).mean(0) < q
        low, high = torch.where(below, middle, low), torch.where(below, high, middle)
    return 0.5 * (low + high)


def interval(means: Tensor, stds: Tensor, level: float) -> tuple[Tensor, Tensor]:
    """The central interval holding ``level`` of the predictive mass: quantiles ``(1 -+ level) / 2``."""
    if not 0.0 < level < 1.0:
        raise InputError(f"an interval level must be strictly between 0 and 1, got {level!r}")
    return quantile(means, stds, (1.0 - level) / 2.0), quantile(means, stds, (1.0 + level) / 2.0)


def _expected_abs(mu: Tensor, sigma: Tensor) -> Tensor:
    """``E|X|`` for ``X ~ N(mu, sigma^2)``: ``2 sigma phi(mu / sigma) + mu (2 Phi(mu / sigma) - 1)``."""
    z = mu / sigma
    return 2.0 * sigma * _normal_pdf(z) + mu * (2.0 * _normal_cdf(z) - 1.0)


def crps(means: Tensor, stds: Tensor, y: Tensor) -> Tensor:
    """The continuous ranked probability score ``(N, D)`` in closed form: ``E|X - y| - E|X - X'| / 2``.

    For a mixture both expectations are sums over components (pairs of components for the second)
    of the folded-normal mean (Grimit et al. 2006); the pairs cost ``K^2`` per example.
    """
    means, stds = check_components(means, stds)
    spread_to_y = _expected_abs(means - y.double(), stds).mean(0)
    pair_means = means[:, None] - means[None, :]
    pair_stds = (stds[:, None] ** 2 + stds[None, :] ** 2).sqrt()
    spread_within = _expected_abs(pair_means, pair_stds).mean((0, 1))
    return spread_to_y - 0.5 * spread_within


def sample_crps(samples: Tensor, y: Tensor) -> Tensor:
    """CRPS ``(N, D)`` of the empirical distribution of ``samples (S, N, D)``: ``mean|x - y| - mean|x - x'| / 2``
    over all ordered pairs, from the sorted samples in ``O(S log S)`` (the form properscoring computes).
    """
    samples = samples.double()
    count = samples.shape[0]
    to_y = (samples - y.double()).abs().mean(0)
    ordered = samples.sort(0).values
    ranks = torch.arange(count, dtype=torch.float64, device=samples.device).view(-1, *[1] * (samples.dim() - 1))
    # sum_{i,j} |x_i - x_j| = 2 sum_i (2 i - S + 1) x_(i) over the sorted samples (0-based i)
    within = 2.0 * ((2.0 * ranks - count + 1.0) * ordered).sum(0) / count**2
    return to_y - 0.5 * within
