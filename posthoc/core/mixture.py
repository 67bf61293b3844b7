"""An equal-weight mixture of Gaussians per output: the predictive of a regression, exactly.

Every regression predictive here is ``p(y | x) = (1/K) Σ_k N(y; μ_k, v_k)`` per example and output (``K = 1`` for a
closed-form Gaussian, ``K`` sampled networks or members otherwise). The density, the CDF and the moments are exact
sums over the components; a mixture's quantile is the root of its CDF, found by bisection between the components' own.

Example:
    >>> import torch
    >>> from posthoc.core.mixture import GaussianMixture
    >>> mix = GaussianMixture(torch.tensor([[[0.0]], [[2.0]]]), torch.ones(2, 1, 1))
    >>> mix.mean(), mix.cdf(torch.tensor([[1.0]]))
    (tensor([[1.]]), tensor([[0.5000]]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.inputs import real_values
from posthoc.errors import InputError

#: bisection steps of a mixture quantile: the bracket shrinks by 2^-64, below float64 resolution
BISECTION_STEPS = 64


def _normal_cdf(z: Tensor) -> Tensor:
    """``Phi(z)`` as ``erfc(-z / sqrt 2) / 2``, accurate to relative precision far into the lower tail (torch's
    ``ndtr`` returns 0 for ``Phi(-10) = 7.6e-24``)."""
    return 0.5 * torch.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class GaussianMixture:
    """``K`` equal-weight Gaussian components for ``N`` examples and ``D`` outputs: ``means`` and ``variances`` (each
    > 0), both ``(K, N, D)``."""

    means: Tensor
    variances: Tensor

    @property
    def components(self) -> int:
        return self.means.shape[0]

    def mean(self) -> Tensor:
        """``(N, D)``: the mixture's mean, the average of the component means."""
        return self.means.mean(0)

    def variance(self) -> Tensor:
        """``(N, D)``: the mixture's variance, ``mean_k v_k + mean_k (μ_k - μ)²`` (the law of total variance)."""
        return self.variances.mean(0) + self.means.var(0, unbiased=False)

    def targets(self, y: Tensor) -> Tensor:
        """``y`` as ``(N, D)`` in the components' dtype, refusing non-numbers, NaN, inf and a shape that does not match."""
        y = real_values(y).to(self.means.device)
        n, d = self.means.shape[1:]
        if y.dim() == 1 and d == 1:
            y = y[:, None]
        if tuple(y.shape) != (n, d):
            raise InputError(
                f"targets have shape {tuple(y.shape)}; this predictive is over {n} examples and {d} output(s): "
                f"pass ({n},) or ({n}, {d})"
            )
        return y.to(self.means.dtype)

    def log_prob(self, y: Tensor) -> Tensor:
        """``(N,)``: ``log p(y)`` of targets ``(N,)`` or ``(N, D)``, joint over the ``D`` outputs.

        Example:
            >>> import torch
            >>> from posthoc.core.mixture import GaussianMixture
            >>> GaussianMixture(torch.zeros(1, 1, 1), torch.ones(1, 1, 1)).log_prob(torch.zeros(1))
            tensor([-0.9189])
        """
        y = self.targets(y)
        per_output = -0.5 * ((y - self.means).square() / self.variances + self.variances.log() + math.log(2 * math.pi))
        return torch.logsumexp(per_output.sum(-1), dim=0) - math.log(self.components)

    def cdf(self, y: Tensor) -> Tensor:
        """``(N, D)``: ``P(Y_d <= y_d)`` per output."""
        y = self.targets(y)
        return _normal_cdf((y - self.means) / self.variances.sqrt()).mean(0)

    def quantile(self, q: float) -> Tensor:
        """``(N, D)``: the ``q``-quantile per output, ``q`` in ``(0, 1)`` (exact; bisection for a mixture).

        Example:
            >>> import torch
            >>> from posthoc.core.mixture import GaussianMixture
            >>> GaussianMixture(torch.zeros(1, 1, 1), torch.ones(1, 1, 1)).quantile(0.975)
            tensor([[1.9600]])
        """
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
            raise InputError(f"a quantile level must be a number in (0, 1), got {q!r}")
        return self.quantile_at(torch.tensor(float(q), dtype=torch.float64))

    def quantile_at(self, levels: Tensor) -> Tensor:
        """``(N, D)``: the quantile at ``levels`` in ``(0, 1)`` broadcast to ``(N, D)`` (e.g. a level per output).

        Example:
            >>> import torch
            >>> from posthoc.core.mixture import GaussianMixture
            >>> GaussianMixture(torch.zeros(1, 1, 2), torch.ones(1, 1, 2)).quantile_at(torch.tensor([0.5, 0.975]))
            tensor([[0.0000, 1.9600]])
        """
        z = torch.special.ndtri(levels.to(device=self.means.device, dtype=torch.float64)).to(self.means.dtype)
        own = self.means + z * self.variances.sqrt()  # each component's own quantile
        if self.components == 1:
            return own[0]
        target = levels.to(device=self.means.device, dtype=self.means.dtype)
        low, high = own.amin(0), own.amax(0)
        for _ in range(BISECTION_STEPS):
            middle = (low + high) / 2
            below = _normal_cdf((middle - self.means) / self.variances.sqrt()).mean(0) < target
            low, high = torch.where(below, middle, low), torch.where(below, high, middle)
        return (low + high) / 2

    def marginal_log_prob(self, y: Tensor) -> Tensor:
        """``(N, D)``: ``log p(y_d)`` per output, each output's own mixture (the outputs' marginals)."""
        y = self.targets(y)
        per_output = -0.5 * ((y - self.means).square() / self.variances + self.variances.log() + math.log(2 * math.pi))
        return torch.logsumexp(per_output, dim=0) - math.log(self.components)

    def interval(self, level: float) -> tuple[Tensor, Tensor]:
        """``(lower, upper)``, each ``(N, D)``: the central interval holding ``level`` of the probability."""
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
            raise InputError(f"an interval level must be a number in (0, 1), e.g. 0.9 for 90%, got {level!r}")
        return self.quantile((1 - level) / 2), self.quantile((1 + level) / 2)

    def crps(self, y: Tensor) -> Tensor:
        """``(N, D)``: the continuous ranked probability score per output, ``E|X - y| - E|X - X'| / 2``, exactly.

        Both are sums over components (pairs for the second) of the folded-normal mean (Grimit et al. 2006).

        Example:
            >>> import torch
            >>> from posthoc.core.mixture import GaussianMixture
            >>> GaussianMixture(torch.zeros(1, 1, 1), torch.ones(1, 1, 1)).crps(torch.zeros(1))   # (sqrt 2 - 1) / sqrt pi
            tensor([[0.2337]])
        """
        y = self.targets(y)
        stds = self.variances.sqrt()
        to_y = _expected_abs(self.means - y, stds).mean(0)
        pair_means = self.means[:, None] - self.means[None, :]
        pair_stds = (self.variances[:, None] + self.variances[None, :]).sqrt()
        return to_y - 0.5 * _expected_abs(pair_means, pair_stds).mean((0, 1))


def _expected_abs(mu: Tensor, sigma: Tensor) -> Tensor:
    """``E|X|`` for ``X ~ N(mu, sigma^2)``: ``2 sigma phi(mu / sigma) + mu (2 Phi(mu / sigma) - 1)``."""
    z = mu / sigma
    return 2.0 * sigma * torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) + mu * (2.0 * _normal_cdf(z) - 1.0)


def sample_crps(samples: Tensor, y: Tensor) -> Tensor:
    """CRPS ``(N, D)`` of the empirical distribution of ``samples (S, N, D)``: ``mean|x - y| - mean|x - x'| / 2``
    over all ordered pairs, from the sorted samples in ``O(S log S)``.

    Example:
        >>> import torch
        >>> from posthoc.core.mixture import sample_crps
        >>> sample_crps(torch.tensor([[[0.0]], [[2.0]]]), torch.tensor([[1.0]]))   # 1 - 1 / 2
        tensor([[0.5000]])
    """
    count = samples.shape[0]
    to_y = (samples - y).abs().mean(0)
    ordered = samples.sort(0).values
    ranks = torch.arange(count, dtype=samples.dtype, device=samples.device).view(-1, *[1] * (samples.dim() - 1))
    # sum_{i,j} |x_i - x_j| = 2 sum_i (2 i - S + 1) x_(i) over the sorted samples (0-based i)
    within = 2.0 * ((2.0 * ranks - count + 1.0) * ordered).sum(0) / count**2
    return to_y - 0.5 * within
