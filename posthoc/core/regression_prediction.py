"""The :class:`RegressionPrediction` of ``um.predict(x)`` under ``likelihood="regression"``.

A predictive over real targets is an equal-weight mixture of ``K`` Gaussians per example and output
(:class:`~posthoc.core.mixture.GaussianMixture`): component ``k`` has mean ``μ_k`` and variance
``m_k + s_k``, the model's (epistemic) variance ``m_k`` (Laplace's ``J Σ Jᵀ``; 0 for a sampled
network or a plain member) plus the observation noise ``s_k`` (aleatoric). The total variance splits
exactly as ``variance = aleatoric + epistemic`` with ``aleatoric = mean_k s_k`` and
``epistemic = mean_k m_k + mean_k (μ_k - μ)²``.

Example:
    >>> pred = RegressionPrediction.from_components(torch.tensor([[[1.0]], [[3.0]]]), None, torch.ones(2, 1, 1))
    >>> pred.mean, pred.aleatoric, pred.epistemic, pred.variance
    (tensor([[2.]]), tensor([[1.]]), tensor([[1.]]), tensor([[2.]]))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.errors import InputError
from posthoc.core.mixture import GaussianMixture


@dataclass(frozen=True)
class RegressionPrediction:
    """A Gaussian (or equal-weight Gaussian mixture) predictive over targets for ``N`` inputs, ``D`` outputs.

    Attributes:
        mean: ``(N, D)`` predictive mean.
        variance: ``(N, D)`` predictive variance, ``aleatoric + epistemic``.
        std: ``(N, D)`` its square root.
        aleatoric: ``(N, D)`` the observation noise's share.
        epistemic: ``(N, D)`` the model's share (its posterior, its samples' or members' spread).
        samples: ``(S, N, D)`` the sampled networks' or members' means, or ``None`` for one Gaussian.
        distribution: the exact mixture, which :meth:`interval`, :meth:`quantile`, :meth:`log_prob`
            and :meth:`cdf` read.
        model_variances: ``(K, N, D)`` each component's model variance.
        noise: ``(K, N, D)`` each component's observation variance (with ``model_variances``, what joining
            chunks and mixing members keeps).
    """

    mean: Tensor
    variance: Tensor
    std: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    samples: Tensor | None
    distribution: GaussianMixture
    model_variances: Tensor
    noise: Tensor

    @classmethod
    def from_components(cls, means: Tensor, model_variances: Tensor | None, noise: Tensor) -> RegressionPrediction:
        """The prediction of ``K`` components: means ``(K, N, D)``, the model's variances ``(K, N, D)`` (``None``:
        points, e.g. sampled networks) and the observation variances ``noise`` (broadcast to ``(K, N, D)``)."""
        noise = noise.expand_as(means)
        model = torch.zeros_like(means) if model_variances is None else model_variances
        aleatoric = noise.mean(0)
        epistemic = model.mean(0) + means.var(0, unbiased=False)
        variance = aleatoric + epistemic
        samples = means if means.shape[0] > 1 else None
        return cls(means.mean(0), variance, variance.sqrt(), aleatoric, epistemic, samples,
                   GaussianMixture(means, model + noise), model, noise)

    def interval(self, level: float) -> tuple[Tensor, Tensor]:
        """``(lower, upper)`` ``(N, D)``: the central interval with probability ``level`` (e.g. 0.9)."""
        return self.distribution.interval(level)

    def quantile(self, q: float) -> Tensor:
        """``(N, D)``: the predictive ``q``-quantile per output."""
        return self.distribution.quantile(q)

    def log_prob(self, y: Tensor) -> Tensor:
        """``(N,)``: the predictive log density of targets ``(N,)`` or ``(N, D)``, joint over the outputs."""
        return self.distribution.log_prob(y)

    def cdf(self, y: Tensor) -> Tensor:
        """``(N, D)``: the predictive CDF at targets ``y`` per output."""
        return self.distribution.cdf(y)

    @property
    def component_means(self) -> Tensor:
        """``(K, N, D)``: each component's mean."""
        return self.distribution.means

    def __len__(self) -> int:
        return self.mean.shape[0]

    @property
    def num_outputs(self) -> int:
        return self.mean.shape[-1]


#: what a prediction is built from (:meth:`RegressionPrediction.from_components`), per component
COMPONENTS = ("component_means", "model_variances", "noise")


def concat(parts: list[RegressionPrediction], keep_samples: bool = True) -> RegressionPrediction:
    """The predictions of consecutive chunks of examples as one (``keep_samples=False`` drops ``samples``)."""
    joined = parts[0] if len(parts) == 1 else RegressionPrediction.from_components(
        *(torch.cat([getattr(p, field) for p in parts], dim=1) for field in COMPONENTS))
    return joined if keep_samples else dataclasses.replace(joined, samples=None)


def mix_predictions(parts: list[RegressionPrediction]) -> RegressionPrediction:
    """The equal-weight mixture of the members' predictions (each with the same number of components).

    Example:
        >>> one = RegressionPrediction.from_components(torch.zeros(1, 2, 1), None, torch.ones(1, 1, 1))
        >>> mix_predictions([one, one]).samples.shape
        torch.Size([2, 2, 1])
    """
    shapes = {tuple(p.distribution.means.shape) for p in parts}
    if len(shapes) > 1:
        raise InputError(f"the members predict different shapes (components, N, D): {sorted(shapes)}; every member must "
                         "predict the same outputs for the same inputs, with the same number of samples")
    return RegressionPrediction.from_components(*(torch.cat([getattr(p, field) for p in parts])
                                                  for field in COMPONENTS))
