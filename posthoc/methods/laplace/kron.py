"""``hessian="kron"``: a Kronecker-factored GGN block, ``G ⊗ A`` (KFAC).

A weight's block is ``G ⊗ A``, ``G (out, out)`` from the output side and ``A (in, in)`` from the inputs; a bias has
``G`` alone. Both are kept as eigen-decompositions, so the posterior
``(G ⊗ A + δ I)⁻¹ = (U_G ⊗ U_A) diag(1 / (λ_i μ_j + δ)) (U_G ⊗ U_A)ᵀ`` is never formed: a head's logits have
``Σ_x = U_G diag(s²) U_Gᵀ`` with ``s_i² = Σ_j ψ_j² / (λ_i μ_j + δ)``, ``ψ = U_Aᵀ phĩ``. A head's weight and bias are
two Kronecker blocks sharing ``G`` (as in BackPACK and laplace-torch), held here as one over ``phĩ = [phi, 1]``.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.kron import KronCurvature
    >>> block = KronCurvature.from_factors(torch.eye(3, dtype=torch.float64), torch.eye(5, dtype=torch.float64))
    >>> block.spectrum().shape, block.sample(torch.zeros(3, 5), 1.0, 4, None).shape
    (torch.Size([15]), torch.Size([4, 3, 5]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import LossHessian
from posthoc.export.modules import cast
from posthoc.methods.laplace.glm_predictive import LogitGaussian
from posthoc.methods.laplace.structure import FLOAT64, Curvature, symmetric_eig


class FoldedKron(nn.Module):
    """The exported :meth:`KronCurvature.head_variance`: ``s² = (phĩ U_A)² @ inverse`` along ``U_G``'s columns."""

    def __init__(self, in_eigvecs: Tensor, inverse: Tensor, out_eigvecs: Tensor) -> None:
        super().__init__()
        self.register_buffer("in_eigvecs", in_eigvecs)
        self.register_buffer("inverse", inverse)
        self.register_buffer("out_eigvecs", out_eigvecs)

    def forward(self, phi_aug: Tensor, mean: Tensor) -> LogitGaussian:
        dtype = phi_aug.dtype
        scale = ((phi_aug @ cast(self.in_eigvecs, dtype)).square() @ cast(self.inverse, dtype)).sqrt()
        return LogitGaussian(mean, scale, cast(self.out_eigvecs, dtype))


class KronCurvature(Curvature):
    """``G ⊗ A`` in eigen-factors; ``in_*`` stay ``None`` for a bias (``G`` alone)."""

    fields = ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs")

    @classmethod
    def from_factors(cls, out_factor: Tensor, in_factor: Tensor | None = None, name: str = "") -> KronCurvature:
        """The block of factors ``G`` and ``A`` (``None`` for a bias), eigen-decomposed."""
        block = cls(name)
        of = f" of {name}" if name else " of the GGN"
        block.out_eigvals, block.out_eigvecs = symmetric_eig(out_factor, f"output factor G{of}")
        if in_factor is not None:
            block.in_eigvals, block.in_eigvecs = symmetric_eig(in_factor, f"input factor A{of}")
        return block

    @classmethod
    def from_sums(cls, sums: list[Tensor], count: int, name: str = "") -> KronCurvature:
        return cls.from_factors(sums[0], sums[1] / count if len(sums) == 2 else None, name)

    def spectrum(self) -> Tensor:
        if self.in_eigvals is None:
            return self.out_eigvals
        return torch.outer(self.out_eigvals, self.in_eigvals).reshape(-1)

    def correlate(self, noise: Tensor, prior_precision: float) -> Tensor:
        dtype, count = noise.dtype, noise.shape[0]
        if self.in_eigvals is None:
            return (noise * torch.rsqrt(self.out_eigvals + prior_precision).to(dtype)) @ self.out_eigvecs.T.to(dtype)
        scale = torch.rsqrt(torch.outer(self.out_eigvals, self.in_eigvals) + prior_precision).to(dtype)
        matrix = noise.reshape(count, self.out_eigvals.shape[0], -1) * scale
        return self.out_eigvecs.to(dtype) @ matrix @ self.in_eigvecs.T.to(dtype)

    def head_variance(self, phi_aug: Tensor, mean: Tensor, prior_precision: float) -> LogitGaussian:
        dtype = phi_aug.dtype
        psi_sq = (phi_aug @ self.in_eigvecs.to(dtype)).square()
        # built in the features' dtype, in place: one (D+1) x C temporary per chunk
        inverse = torch.outer(self.in_eigvals.to(dtype), self.out_eigvals.to(dtype)).add_(prior_precision).reciprocal_()
        return LogitGaussian(mean.to(dtype), (psi_sq @ inverse).sqrt_(), self.out_eigvecs.to(dtype))

    def head_factors(self, phi_aug: Tensor) -> Tensor:
        """``ψ² = (U_Aᵀ phĩ)²`` ``(n, D+1)``: the variances along ``U_G`` are ``ψ² @ 1/(λ μ + δ)``."""
        return (phi_aug @ self.in_eigvecs.to(phi_aug.dtype)).square()

    def head_spread(self, prior_precision: float, dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor]:
        inverse = torch.outer(self.in_eigvals.to(dtype), self.out_eigvals.to(dtype)).add_(prior_precision).reciprocal_()
        basis_sq = self.out_eigvecs.to(dtype).square().T
        return lambda factors, mean: (factors @ inverse) @ basis_sq

    def fold_head(self, prior_precision: float, classes: int, width: int) -> FoldedKron:
        inverse = torch.outer(self.in_eigvals, self.out_eigvals).add(prior_precision).reciprocal()
        return FoldedKron(self.in_eigvecs.float().clone(), inverse.float(), self.out_eigvecs.float().clone())

    def jacobian_variance(self, g: Tensor, a: Tensor | None, prior_precision: float) -> Tensor:
        out_vecs = self.out_eigvecs.to(g.dtype)
        if a is None:
            rotated = (g if g.dim() == 3 else g.sum(2)) @ out_vecs
            return torch.einsum(
                "nci,i,ndi->ncd", rotated, 1.0 / (self.out_eigvals.to(g.dtype) + prior_precision), rotated
            )
        in_vecs = self.in_eigvecs.to(g.dtype)
        if a.dim() == 2:
            rotated = g @ out_vecs  # (n, C, out)
            psi_sq = (a @ in_vecs).square()  # (n, in)
            inverse = 1.0 / (torch.outer(self.in_eigvals, self.out_eigvals).to(g.dtype) + prior_precision)  # (in, out)
            return torch.einsum("nci,ni,ndi->ncd", rotated, psi_sq @ inverse, rotated)
        jacobian = torch.einsum("ncto,nti->ncoi", g @ out_vecs, a @ in_vecs)  # in the eigenbasis, per example
        inverse = 1.0 / (torch.outer(self.out_eigvals, self.in_eigvals).to(g.dtype) + prior_precision)  # (out, in)
        return torch.einsum("ncoi,oi,ndoi->ncd", jacobian, inverse, jacobian)

    def dense(self) -> Tensor:
        out = self.out_eigvecs @ torch.diag(self.out_eigvals) @ self.out_eigvecs.T
        if self.in_eigvals is None:
            return out
        return torch.kron(out, self.in_eigvecs @ torch.diag(self.in_eigvals) @ self.in_eigvecs.T)

    @classmethod
    def head_statistics(cls, num_classes: int, width: int, device: torch.device | str) -> dict[str, Tensor]:
        return {
            "out_factor": torch.zeros(num_classes, num_classes, dtype=FLOAT64, device=device),
            "in_factor": torch.zeros(width, width, dtype=FLOAT64, device=device),
        }

    @classmethod
    def accumulate(cls, statistics: dict[str, Tensor], phi_aug: Tensor, hessian: LossHessian) -> None:
        statistics["out_factor"] += hessian.summed()
        statistics["in_factor"] += (phi_aug.T @ phi_aug).to(FLOAT64)

    @classmethod
    def from_head_statistics(cls, statistics: dict[str, Tensor], num_data: int, bias: bool) -> KronCurvature:
        in_factor = statistics["in_factor"] / num_data
        if bias:  # the bias is its own Kronecker block G ⊗ 1: drop the weight-bias coupling
            in_factor[-1, :-1] = 0
            in_factor[:-1, -1] = 0
        return cls.from_factors(statistics["out_factor"], in_factor)

    @classmethod
    def head_row_bytes(cls, num_classes: int, width: int, itemsize: int) -> int:
        return 2 * width * itemsize  # phĩ U_A and its square
