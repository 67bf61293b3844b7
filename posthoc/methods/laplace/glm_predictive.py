"""The linearised (GLM) predictive of a last-layer Laplace posterior, in logit space.

For a linear head the logits are linear in the weights, so a Gaussian posterior over the head
gives Gaussian logits ``f ~ N(m, Σ_x)`` per input, with ``Σ_x = B diag(s²) Bᵀ``:

- KFAC: ``B = U_G`` (shared, ``C x C``), ``s_i² = Σ_j ψ_j² / (λ_i μ_j + δ)`` with
  ``ψ = U_Aᵀ phĩ``: one ``(D+1) x (D+1)`` and one ``(D+1) x C`` product per input;
- diag: ``B = I``, ``s_c² = Σ_d phĩ_d² / (h_cd + δ)``;
- full: ``B, s`` from the eigen-decomposition of the ``C x C`` matrix ``J Σ Jᵀ``.

The Jacobian ``I ⊗ phĩᵀ`` is never formed. Links: ``probit`` (``softmax(m / sqrt(1 + π/8 ·
diag Σ))``), ``mc`` (``S`` logit samples drawn at once, cost independent of the feature width),
``bridge`` (the Laplace bridge to a Dirichlet, from the diagonal and row sums of ``Σ``). Rows are
processed in chunks that keep temporaries under the memory budget (:func:`chunked_log_predictive`).

Example:
    >>> g = LogitGaussian(torch.zeros(2, 3), torch.ones(2, 3), None)
    >>> probit_log_probs(g).exp().sum(-1)
    tensor([1., 1.])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.chunks import chunks
from posthoc.core.errors import ConfigError
from posthoc.core.logits import log_mean_exp
from posthoc.engine.random_draws import randn

LINKS = ("probit", "mc", "bridge")


@dataclass
class LogitGaussian:
    """Gaussian logits ``N(mean, B diag(scale²) Bᵀ)`` for a batch.

    Attributes:
        mean: ``(N, C)``.
        scale: ``(N, K)`` standard deviations along the columns of ``basis``.
        basis: ``None`` (identity, ``K = C``), a shared ``(C, K)`` matrix, or per-input ``(N, C, K)``.
    """

    mean: Tensor
    scale: Tensor
    basis: Tensor | None

    def variance(self) -> Tensor:
        """Diagonal of the covariance, ``(N, C)``."""
        var = self.scale.square()
        if self.basis is None:
            return var
        if self.basis.dim() == 2:
            return var @ self.basis.square().T
        return torch.einsum("nk,nck->nc", var, self.basis.square())

    def covariance(self) -> Tensor:
        """The full covariance ``(N, C, C)`` (for tests and small ``C``)."""
        if self.basis is None:
            return torch.diag_embed(self.scale.square())
        basis = self.basis.expand(self.mean.shape[0], -1, -1) if self.basis.dim() == 2 else self.basis
        factor = basis * self.scale[:, None, :]
        return factor @ factor.transpose(1, 2)

    def row_sums(self) -> Tensor:
        """``Σ 1``: row sums of the covariance, ``(N, C)``."""
        var = self.scale.square()
        if self.basis is None:
            return var
        if self.basis.dim() == 2:
            return (var * self.basis.sum(0)) @ self.basis.T
        return torch.einsum("nck,nk->nc", self.basis, var * self.basis.sum(1))

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """``num_samples`` logit draws ``(S, N, C)``, all in one batched operation."""
        noise = randn((num_samples, *self.scale.shape), generator=generator, device=self.scale.device, dtype=self.scale.dtype)
        noise = noise * self.scale
        if self.basis is None:
            return self.mean + noise
        if self.basis.dim() == 2:
            return self.mean + noise @ self.basis.T
        return self.mean + torch.einsum("snk,nck->snc", noise, self.basis)


def probit_log_probs(g: LogitGaussian) -> Tensor:
    """Probit approximation: ``log softmax(m / sqrt(1 + π/8 · diag Σ))``."""
    kappa = torch.rsqrt(1 + math.pi / 8 * g.variance())
    return torch.log_softmax(kappa * g.mean, dim=-1)


def bridge_log_probs(g: LogitGaussian) -> Tensor:
    """The Laplace bridge: the mean of the Dirichlet matched to the (zero-sum corrected) Gaussian."""
    var_diag, row_sums = g.variance(), g.row_sums()
    total = row_sums.sum(-1, keepdim=True).clamp_min(torch.finfo(g.mean.dtype).tiny)
    mean = g.mean - row_sums * g.mean.sum(-1, keepdim=True) / total
    var = (var_diag - row_sums.square() / total).clamp_min(torch.finfo(g.mean.dtype).eps)
    classes = mean.shape[-1]
    sum_exp = torch.exp(-mean).sum(-1, keepdim=True)
    alpha = (1 - 2 / classes + mean.exp() / classes**2 * sum_exp) / var
    return torch.log(alpha) - torch.log(alpha.sum(-1, keepdim=True))


def mc_log_probs(g: LogitGaussian, num_samples: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Monte Carlo: ``(log mean_s softmax(f_s), log softmax(f_s))`` from ``S`` logit samples."""
    sample_log_probs = torch.log_softmax(g.sample(num_samples, generator), dim=-1)
    return log_mean_exp(sample_log_probs), sample_log_probs


def log_predictive(g: LogitGaussian, link: str, num_samples: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor | None]:
    """Apply ``link`` to Gaussian logits; returns ``(log_probs, sample_log_probs or None)``."""
    if link == "probit":
        return probit_log_probs(g), None
    if link == "bridge":
        return bridge_log_probs(g), None
    if link == "mc":
        return mc_log_probs(g, num_samples, generator)
    raise ConfigError(f"link must be one of {LINKS}, got {link!r}")


def kron_logits(phi_aug: Tensor, mean: Tensor, out_eigvals: Tensor, out_eigvecs: Tensor, in_eigvals: Tensor, in_eigvecs: Tensor, prior_precision: float) -> LogitGaussian:
    """Logit Gaussian of a KFAC posterior ``(G ⊗ A + δ I)⁻¹`` (see module docs)."""
    dtype = phi_aug.dtype
    psi_sq = (phi_aug @ in_eigvecs.to(dtype)).square()
    # built in the features' dtype, in place: one (D+1) x C temporary per chunk
    inverse = torch.outer(in_eigvals.to(dtype), out_eigvals.to(dtype)).add_(prior_precision).reciprocal_()
    return LogitGaussian(mean.to(dtype), (psi_sq @ inverse).sqrt_(), out_eigvecs.to(dtype))


def diag_logits(phi_aug: Tensor, mean: Tensor, diagonal: Tensor, prior_precision: float) -> LogitGaussian:
    """Logit Gaussian of a diagonal posterior; ``diagonal`` is the GGN diagonal ``(C, D+1)``."""
    dtype = phi_aug.dtype
    variance = phi_aug.square() @ (1.0 / (diagonal + prior_precision)).T.to(dtype)
    return LogitGaussian(mean.to(dtype), variance.sqrt(), None)


def full_logits(phi_aug: Tensor, mean: Tensor, eigvals: Tensor, eigvecs: Tensor, prior_precision: float) -> LogitGaussian:
    """Logit Gaussian of a full posterior ``(GGN + δ I)⁻¹`` given the GGN's eigen-decomposition."""
    dtype = torch.promote_types(phi_aug.dtype, torch.float64)
    classes, width = mean.shape[1], phi_aug.shape[1]
    root = (eigvecs * torch.rsqrt(eigvals + prior_precision)).to(dtype)  # Σ = root rootᵀ
    projected = torch.einsum("nd,cdp->ncp", phi_aug.to(dtype), root.reshape(classes, width, -1))
    covariance = projected @ projected.transpose(1, 2)
    values, vectors = torch.linalg.eigh(covariance)
    out = phi_aug.dtype
    return LogitGaussian(mean.to(out), values.clamp_min(0).sqrt().to(out), vectors.to(out))


def bytes_per_row(structure: str, link: str, classes: int, width: int, samples: int, dtype: torch.dtype) -> int:
    """Bytes one input row keeps alive at the peak of ``<structure>_logits`` and ``link``, for :mod:`posthoc.core.chunks`.

    ``width`` is that of ``phĩ``. Per row: ``phĩ U_A`` and its square (kron) or ``phĩ²`` (diag);
    for full, the ``C x P`` projection (``P = C · width``), the ``C x C`` covariance and its
    eigenvectors in float64; about seven ``C``-vectors (mean, scale, the link's temporaries); and
    three ``S x C`` blocks of logit samples for ``mc``.

    Example:
        >>> bytes_per_row("diag", "probit", classes=10, width=65, samples=0, dtype=torch.float32)
        540
    """
    elements = {"kron": 2 * width, "diag": width, "full": 0}[structure] + 7 * classes
    if link == "mc":
        elements += 3 * samples * classes
    dense = 8 * (classes * classes * width + 3 * classes * classes) if structure == "full" else 0
    return elements * (torch.finfo(dtype).bits // 8) + dense


def chunked_log_predictive(total: int, row_bytes: int, gaussian: Callable[[slice], LogitGaussian], link: str, num_samples: int,
                           generator: torch.Generator | None = None, *, max_memory: int | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`log_predictive` of ``total`` rows in chunks whose ``row_bytes`` each fit ``max_memory``;
    ``gaussian(rows)`` builds the Gaussian logits of one chunk. Samples ``(S, n, C)`` join along rows.

    Example:
        >>> gaussian = lambda rows: LogitGaussian(torch.zeros(rows.stop - rows.start, 3), torch.ones(rows.stop - rows.start, 3), None)
        >>> chunked_log_predictive(5, 10**6, gaussian, "mc", 4, max_memory=2 * 10**6)[1].shape
        torch.Size([4, 5, 3])
    """
    parts = [log_predictive(gaussian(rows), link, num_samples, generator) for rows in chunks(total, row_bytes, max_memory=max_memory)]
    log_probs = torch.cat([chunk for chunk, _ in parts])
    if parts[0][1] is None:
        return log_probs, None
    return log_probs, torch.cat([samples for _, samples in parts], dim=1)
