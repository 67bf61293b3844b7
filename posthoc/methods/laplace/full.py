"""``hessian="full"``: the dense GGN of a block, kept as its eigen-decomposition ``V diag(λ) Vᵀ``.

For a linear head the GGN is exact and closed-form from one pass, ``C(D+1) x C(D+1)``, and the posterior is
``Σ = R Rᵀ`` with ``R = V diag((λ + δ)^-½)``. The logits' variance needs only the ``C`` diagonal blocks
``Σ_cc = V_c diag(σ_c) V_cᵀ`` (eigen-decomposed once per prior precision): ``s_c² = Σ_k σ_ck (V_cᵀ phĩ)_k²``, all the
probit link reads. The full ``C x C`` covariance and its eigen-factor are made only for ``mc`` and ``bridge``.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.full import FullCurvature
    >>> block = FullCurvature.from_matrix(torch.eye(6, dtype=torch.float64))
    >>> block.head_variance(torch.ones(4, 3), torch.zeros(4, 2), 1.0).variance()
    tensor([[1.5000, 1.5000], [1.5000, 1.5000], [1.5000, 1.5000], [1.5000, 1.5000]])
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import LossHessian
from posthoc.errors import ConfigError
from posthoc.export.modules import cast
from posthoc.methods.laplace.glm_predictive import DenseLogitGaussian, LogitGaussian
from posthoc.methods.laplace.structure import FLOAT64, Curvature, symmetric_eig


class FoldedFull(nn.Module):
    """The exported :meth:`FullCurvature.head_variance`: ``s_c² = (phĩ V)² @ S``, the probit link's diagonal."""

    def __init__(self, vectors: Tensor, spread: Tensor) -> None:
        super().__init__()
        self.register_buffer("vectors", vectors)
        self.register_buffer("spread", spread)

    def forward(self, phi_aug: Tensor, mean: Tensor) -> LogitGaussian:
        dtype = phi_aug.dtype
        scale = ((phi_aug @ cast(self.vectors, dtype)).square() @ cast(self.spread, dtype)).sqrt()
        return LogitGaussian(mean, scale, None)


class FullCurvature(Curvature):
    """The dense GGN in eigen-form ``eigvals (P,)``, ``eigvecs (P, P)``."""

    fields = ("eigvals", "eigvecs")

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        #: ``(key, (V, S))``: the head's diagonal posterior blocks at the last δ (:meth:`_diagonal_blocks`)
        self._head_blocks: tuple[tuple, tuple[Tensor, Tensor]] | None = None

    @classmethod
    def from_matrix(cls, matrix: Tensor, name: str = "") -> FullCurvature:
        """The block of a dense (symmetric, PSD up to round-off) GGN, eigen-decomposed."""
        block = cls(name)
        block.eigvals, block.eigvecs = symmetric_eig(matrix, f"GGN{' of ' + name if name else ' of the last layer'}")
        return block

    @classmethod
    def from_sums(cls, sums: list[Tensor], count: int, name: str = "") -> FullCurvature:
        return cls.from_matrix(sums[0], name)

    def spectrum(self) -> Tensor:
        return self.eigvals

    def root(self, prior_precision: float, dtype: torch.dtype = FLOAT64) -> Tensor:
        """``R`` with ``R Rᵀ = (GGN + δ I)⁻¹``, ``(P, P)``."""
        return (self.eigvecs * torch.rsqrt(self.eigvals + prior_precision)).to(dtype)

    def correlate(self, noise: Tensor, prior_precision: float) -> Tensor:
        flat = noise.reshape(noise.shape[0], -1)
        return (flat * torch.rsqrt(self.eigvals + prior_precision).to(noise.dtype)) @ self.eigvecs.T.to(noise.dtype)

    def head_variance(self, phi_aug: Tensor, mean: Tensor, prior_precision: float) -> DenseLogitGaussian:
        dtype = torch.promote_types(phi_aug.dtype, torch.float64)
        wide = phi_aug.to(dtype)
        classes, width = mean.shape[1], phi_aug.shape[1]

        def covariance() -> Tensor:
            root = self.root(prior_precision, dtype).reshape(classes, width, -1)
            projected = torch.einsum("nd,cdp->ncp", wide, root)
            return projected @ projected.transpose(1, 2)

        vectors, spread = self._diagonal_blocks(prior_precision, classes, width, phi_aug.dtype)
        variance = (phi_aug @ vectors).square_() @ spread  # Σ_k σ_ck (V_cᵀ phĩ)_k², (n, C)
        return DenseLogitGaussian(mean.to(phi_aug.dtype), covariance, variance)

    def _diagonal_blocks(
        self, prior_precision: float, classes: int, width: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """``V (D+1, C (D+1))``, the eigenvectors of every ``Σ_cc`` side by side, and ``S (C (D+1), C)`` with their
        eigenvalues in column ``c``; cached for the last prior precision, dtype and buffers."""
        key = (float(prior_precision), self.eigvecs, self.eigvecs._version, self.eigvals._version, dtype)
        if self._head_blocks is not None:
            (delta, vectors, *rest), blocks = self._head_blocks
            if delta == key[0] and vectors is key[1] and rest == list(key[2:]):
                return blocks
        root = self.root(prior_precision).reshape(classes, width, -1)
        values, vectors = torch.linalg.eigh(root @ root.transpose(1, 2))  # (C, D+1), (C, D+1, D+1)
        spread = torch.block_diag(*values.clamp_min(0)[:, :, None])  # (C (D+1), C)
        self._head_blocks = (key, (vectors.permute(1, 0, 2).reshape(width, -1).to(dtype), spread.to(dtype)))
        return self._head_blocks[1]

    def fold_head(self, prior_precision: float, classes: int, width: int) -> FoldedFull:
        vectors, spread = self._diagonal_blocks(prior_precision, classes, width, torch.float32)
        return FoldedFull(vectors.clone(), spread.clone())

    def jacobian_variance(self, g: Tensor, a: Tensor | None, prior_precision: float) -> Tensor:
        if a is None:
            jacobian = g if g.dim() == 3 else g.sum(2)
        elif a.dim() == 2:
            jacobian = (g[..., :, None] * a[:, None, None, :]).flatten(2)
        else:
            jacobian = torch.einsum("ncto,nti->ncoi", g, a).flatten(2)
        projected = jacobian @ self.root(prior_precision, g.dtype)
        return projected @ projected.transpose(1, 2)

    def dense(self) -> Tensor:
        return self.eigvecs @ torch.diag(self.eigvals) @ self.eigvecs.T

    @classmethod
    def head_statistics(cls, num_classes: int, width: int, device: torch.device | str) -> dict[str, Tensor]:
        params = num_classes * width
        return {"matrix": torch.zeros(params, params, dtype=FLOAT64, device=device)}

    @classmethod
    def accumulate(cls, statistics: dict[str, Tensor], phi_aug: Tensor, hessian: LossHessian) -> None:
        # Σ_n (diag d_n - u_n u_nᵀ) ⊗ phĩ phĩᵀ = Σ_c e_c e_cᵀ ⊗ phĩᵀ diag(d_c) phĩ - ZᵀZ, Z = u ⊙ phĩ
        # (the softmax: d = u = p; a Gaussian: d = 1, no u)
        phi_aug = phi_aug.to(FLOAT64)
        rows, width = phi_aug.shape
        diagonal_part, low_rank = hessian.parts()
        scaled = diagonal_part[:, :, None] * phi_aug[:, None, :]  # (N, C, D+1)
        if low_rank is None:
            update = scaled.new_zeros(scaled.shape[1] * width, scaled.shape[1] * width)
        else:
            outer = scaled if low_rank is diagonal_part else low_rank[:, :, None] * phi_aug[:, None, :]
            update = -(outer.reshape(rows, -1).T @ outer.reshape(rows, -1))
        blocks = scaled.permute(1, 2, 0) @ phi_aug  # (C, D+1, D+1): phĩᵀ diag(d_c) phĩ
        for c in range(diagonal_part.shape[1]):
            span = slice(c * width, (c + 1) * width)
            update[span, span] += blocks[c]
        statistics["matrix"] += update

    @classmethod
    def from_head_statistics(cls, statistics: dict[str, Tensor], num_data: int, bias: bool) -> FullCurvature:
        return cls.from_matrix(statistics["matrix"])

    @classmethod
    def check_head_memory(cls, num_classes: int, width: int, budget_bytes: float) -> None:
        params = num_classes * width
        needed = 2 * params * params * 8  # the GGN and its eigenvectors, in float64
        if needed > budget_bytes:
            raise ConfigError(
                f"hessian='full' on this head needs a {params:,} x {params:,} matrix and its eigenvectors "
                f"({needed / 2**30:.1f} GiB in float64), over the memory budget of {budget_bytes / 2**30:.1f} "
                "GiB. Use hessian='kron' (Kronecker factors, the default) or hessian='diag', or raise the budget "
                "with wrap(..., max_memory=<bytes>) if the machine really has the memory"
            )

    @classmethod
    def head_row_bytes(cls, num_classes: int, width: int, itemsize: int) -> int:
        # the C x P projection (P = C · width), the C x C covariance and its eigenvectors, in float64
        return 8 * (num_classes * num_classes * width + 3 * num_classes * num_classes)
