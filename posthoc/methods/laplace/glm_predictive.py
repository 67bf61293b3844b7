"""Gaussian logits and the links that turn them into class probabilities.

A linearised Laplace posterior gives Gaussian logits ``f ~ N(m, Σ_x)`` per input, in the form cheapest for its
structure: :class:`LogitGaussian` (``Σ_x = B diag(s²) Bᵀ``), :class:`IndependentLogits` (a diagonal) or
:class:`DenseLogitGaussian` (a dense ``C x C`` covariance made when first needed). Links: ``probit``
(``softmax(m / sqrt(1 + π/8 · diag Σ))``), ``mc`` (``S`` logit samples at once), ``bridge`` (the Laplace bridge to a
Dirichlet, from the diagonal and row sums of ``Σ``).

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.glm_predictive import LogitGaussian, probit_log_probs
    >>> g = LogitGaussian(torch.zeros(2, 3), torch.ones(2, 3), None)
    >>> probit_log_probs(g).exp().sum(-1).round(decimals=4)   # rounded: the last float digits vary by build
    tensor([1., 1.])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from posthoc.core.chunks import chunks
from posthoc.core.logits import log_mean_exp
from posthoc.engine.random_draws import randn
from posthoc.errors import ConfigError

LINKS = ("probit", "mc", "bridge")


class GaussianLogits(Protocol):
    """What the links read of Gaussian logits for a batch of ``N`` inputs and ``C`` classes."""

    mean: Tensor

    def variance(self) -> Tensor:
        """Diagonal of the covariance, ``(N, C)``."""

    def row_sums(self) -> Tensor:
        """Row sums of the covariance, ``(N, C)``."""

    def covariance(self) -> Tensor:
        """The full covariance ``(N, C, C)``."""

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """``num_samples`` logit draws ``(S, N, C)``."""


@dataclass
class LogitGaussian:
    """Gaussian logits ``N(mean (N, C), B diag(scale²) Bᵀ)``, ``scale (N, K)`` along the columns of ``basis``: ``None``
    (identity, ``K = C``), a shared ``(C, K)`` matrix, or per-input ``(N, C, K)``."""

    mean: Tensor
    scale: Tensor
    basis: Tensor | None

    def variance(self) -> Tensor:
        var = self.scale.square()
        if self.basis is None:
            return var
        if self.basis.dim() == 2:
            return var @ self.basis.square().T
        return torch.einsum("nk,nck->nc", var, self.basis.square())

    def covariance(self) -> Tensor:
        if self.basis is None:
            return torch.diag_embed(self.scale.square())
        basis = self.basis.expand(self.mean.shape[0], -1, -1) if self.basis.dim() == 2 else self.basis
        factor = basis * self.scale[:, None, :]
        return factor @ factor.transpose(1, 2)

    def row_sums(self) -> Tensor:
        var = self.scale.square()
        if self.basis is None:
            return var
        if self.basis.dim() == 2:
            return (var * self.basis.sum(0)) @ self.basis.T
        return torch.einsum("nck,nk->nc", self.basis, var * self.basis.sum(1))

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """``num_samples`` logit draws ``(S, N, C)``, all in one batched operation."""
        noise = randn(
            (num_samples, *self.scale.shape), generator=generator, device=self.scale.device, dtype=self.scale.dtype
        )
        noise = noise * self.scale
        if self.basis is None:
            return self.mean + noise
        if self.basis.dim() == 2:
            return self.mean + noise @ self.basis.T
        return self.mean + torch.einsum("snk,nck->snc", noise, self.basis)


@dataclass
class IndependentLogits:
    """Independent Gaussian logits ``N(mean, diag(var))``, held by their variances ``(N, C)`` (no square root).

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.glm_predictive import IndependentLogits
        >>> g = IndependentLogits(torch.zeros(2, 3), torch.full((2, 3), 4.0))
        >>> g.variance()[0], g.sample(5).shape
        (tensor([4., 4., 4.]), torch.Size([5, 2, 3]))
    """

    mean: Tensor
    var: Tensor

    def variance(self) -> Tensor:
        return self.var

    def row_sums(self) -> Tensor:
        return self.var

    def covariance(self) -> Tensor:
        return torch.diag_embed(self.var)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        noise = randn((num_samples, *self.var.shape), generator=generator, device=self.var.device, dtype=self.var.dtype)
        return self.mean + noise * self.var.sqrt()


class DenseLogitGaussian:
    """Gaussian logits with a dense covariance ``(N, C, C)``, given or built by a function when first needed;
    ``variance``, when given, is its diagonal computed more cheaply (the probit link never builds the covariance).

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.glm_predictive import DenseLogitGaussian
        >>> g = DenseLogitGaussian(torch.zeros(2, 3), torch.eye(3).expand(2, 3, 3))
        >>> g.variance(), g.sample(4).shape
        (tensor([[1., 1., 1.], [1., 1., 1.]]), torch.Size([4, 2, 3]))
    """

    def __init__(self, mean: Tensor, covariance: Tensor | Callable[[], Tensor], variance: Tensor | None = None) -> None:
        self.mean = mean
        self._covariance = covariance
        self._variance = variance

    def covariance(self) -> Tensor:
        if callable(self._covariance):
            self._covariance = self._covariance()
        return self._covariance

    def variance(self) -> Tensor:
        if self._variance is None:
            self._variance = self.covariance().diagonal(dim1=1, dim2=2).to(self.mean.dtype)
        return self._variance

    def row_sums(self) -> Tensor:
        return self.covariance().sum(-1).to(self.mean.dtype)

    def factor(self) -> LogitGaussian:
        """The same Gaussian as :class:`LogitGaussian`: scales and eigenvectors of each covariance."""
        values, vectors = torch.linalg.eigh(self.covariance())
        return LogitGaussian(self.mean, values.clamp_min(0).sqrt().to(self.mean.dtype), vectors.to(self.mean.dtype))

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        return self.factor().sample(num_samples, generator)


def probit_logits(g: GaussianLogits, overwrite: bool = False) -> Tensor:
    """The probit's scaled logits ``m / sqrt(1 + π/8 · diag Σ)``; ``overwrite``: built in ``g``'s variance itself
    (for a caller that drops ``g`` after), else in one ``(N, C)`` temporary, updated in place."""
    var = g.variance()
    scaled = var.mul_(math.pi / 8) if overwrite else var.mul(math.pi / 8)
    return scaled.add_(1).rsqrt_().mul_(g.mean)


def probit_log_probs(g: GaussianLogits) -> Tensor:
    """Probit approximation: ``log softmax(m / sqrt(1 + π/8 · diag Σ))``."""
    return torch.log_softmax(probit_logits(g), dim=-1)


def bridge_log_probs(g: GaussianLogits) -> Tensor:
    """The Laplace bridge: the mean of the Dirichlet matched to the (zero-sum corrected) Gaussian."""
    var_diag, row_sums = g.variance(), g.row_sums()
    total = row_sums.sum(-1, keepdim=True).clamp_min(torch.finfo(g.mean.dtype).tiny)
    mean = g.mean - row_sums * g.mean.sum(-1, keepdim=True) / total
    var = (var_diag - row_sums.square() / total).clamp_min(torch.finfo(g.mean.dtype).eps)
    classes = mean.shape[-1]
    sum_exp = torch.exp(-mean).sum(-1, keepdim=True)
    alpha = (1 - 2 / classes + mean.exp() / classes**2 * sum_exp) / var
    return torch.log(alpha) - torch.log(alpha.sum(-1, keepdim=True))


def mc_log_probs(
    g: GaussianLogits, num_samples: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Monte Carlo: ``(log mean_s softmax(f_s), log softmax(f_s))`` from ``S`` logit samples."""
    sample_log_probs = torch.log_softmax(g.sample(num_samples, generator), dim=-1)
    return log_mean_exp(sample_log_probs), sample_log_probs


def log_predictive(
    g: GaussianLogits, link: str, num_samples: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor | None]:
    """Apply ``link`` to Gaussian logits; returns ``(log_probs, sample_log_probs or None)``."""
    if link == "probit":
        return probit_log_probs(g), None
    if link == "bridge":
        return bridge_log_probs(g), None
    if link == "mc":
        return mc_log_probs(g, num_samples, generator)
    raise ConfigError(f"link must be one of {LINKS}, got {link!r}")


def link_row_bytes(link: str, classes: int, samples: int, itemsize: int) -> int:
    """Bytes one input row keeps alive in the logits and ``link``: about seven ``C``-vectors, and for ``mc`` three
    ``S x C`` blocks of logit samples.

    Example:
        >>> from posthoc.methods.laplace.glm_predictive import link_row_bytes
        >>> link_row_bytes("probit", classes=10, samples=0, itemsize=4)
        280
    """
    elements = 7 * classes + (3 * samples * classes if link == "mc" else 0)
    return elements * itemsize


def chunked_log_predictive(
    total: int,
    row_bytes: int,
    gaussian: Callable[[slice], GaussianLogits],
    link: str,
    num_samples: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`log_predictive` of ``total`` rows in chunks of ``row_bytes`` each under the memory budget;
    ``gaussian(rows)`` builds one chunk's Gaussian logits.

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.glm_predictive import LogitGaussian, chunked_log_predictive
        >>> from posthoc.core.chunks import budget_scope
        >>> def gaussian(rows):
        ...     return LogitGaussian(torch.zeros(rows.stop - rows.start, 3), torch.ones(rows.stop - rows.start, 3), None)
        >>> with budget_scope(2 * 10**6):
        ...     chunked_log_predictive(5, 10**6, gaussian, "mc", 4)[1].shape
        torch.Size([4, 5, 3])
    """
    if link == "probit":  # each chunk's log-probabilities written in place: no (N, C) copy joins them
        log_probs: Tensor | None = None
        for rows in chunks(total, row_bytes):
            scaled = probit_logits(gaussian(rows), overwrite=True)
            if log_probs is None:
                log_probs = scaled.new_empty((total, *scaled.shape[1:]))
            torch.log_softmax(scaled, dim=-1, out=log_probs[rows])
        return log_probs, None
    parts = [log_predictive(gaussian(rows), link, num_samples, generator) for rows in chunks(total, row_bytes)]
    log_probs = torch.cat([chunk for chunk, _ in parts])
    if parts[0][1] is None:
        return log_probs, None
    return log_probs, torch.cat([samples for _, samples in parts], dim=1)
