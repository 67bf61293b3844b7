"""``hessian="diag"``: the diagonal of the GGN, so the posterior is ``diag(1 / (h + δ))``.

A weight's diagonal keeps its shape ``(out, in)``; a head's covers ``[W, b]`` as ``(C, D+1)``, with
``h_cd = Σ_n (H_n)_cc phĩ_nd²`` and independent logits ``s_c² = Σ_d phĩ_d² / (h_cd + δ)``.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.diag import DiagCurvature
    >>> block = DiagCurvature.from_diagonal(torch.ones(3, 5, dtype=torch.float64))
    >>> block.head_variance(torch.ones(2, 5), torch.zeros(2, 3), 1.0).scale.square()
    tensor([[2.5000, 2.5000, 2.5000],
            [2.5000, 2.5000, 2.5000]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import LossHessian
from posthoc.export.modules import cast
from posthoc.methods.laplace.glm_predictive import LogitGaussian
from posthoc.methods.laplace.structure import FLOAT64, Curvature, clamp_curvature


class FoldedDiag(nn.Module):
    """The exported :meth:`DiagCurvature.head_variance`: ``s_c² = phĩ² @ (1 / (h + δ))``."""

    def __init__(self, inverse: Tensor) -> None:
        super().__init__()
        self.register_buffer("inverse", inverse)

    def forward(self, phi_aug: Tensor, mean: Tensor) -> LogitGaussian:
        return LogitGaussian(mean, (phi_aug.square() @ cast(self.inverse, phi_aug.dtype)).sqrt(), None)


class DiagCurvature(Curvature):
    """The GGN diagonal, shaped like the parameter it covers."""

    fields = ("diagonal",)

    @classmethod
    def from_diagonal(cls, diagonal: Tensor, name: str = "") -> DiagCurvature:
        """The block of a GGN diagonal (clamped at 0, with a warning where it was clearly negative)."""
        block = cls(name)
        block.diagonal = clamp_curvature(diagonal.clone(), f"GGN diagonal{' of ' + name if name else ''}")
        return block

    @classmethod
    def from_sums(cls, sums: list[Tensor], count: int, name: str = "") -> DiagCurvature:
        return cls.from_diagonal(sums[0], name)

    def spectrum(self) -> Tensor:
        return self.diagonal.reshape(-1)

    def correlate(self, noise: Tensor, prior_precision: float) -> Tensor:
        return noise * torch.rsqrt(self.diagonal + prior_precision).to(noise.dtype)

    def head_variance(self, phi_aug: Tensor, mean: Tensor, prior_precision: float) -> LogitGaussian:
        dtype = phi_aug.dtype
        variance = phi_aug.square() @ (1.0 / (self.diagonal + prior_precision)).T.to(dtype)
        return LogitGaussian(mean.to(dtype), variance.sqrt(), None)

    def head_factors(self, phi_aug: Tensor) -> Tensor:
        return phi_aug.square()

    def head_spread(self, prior_precision: float, dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor]:
        table = (1.0 / (self.diagonal + prior_precision)).T.to(dtype)
        return lambda factors, mean: factors @ table

    def fold_head(self, prior_precision: float, classes: int, width: int) -> FoldedDiag:
        return FoldedDiag((1.0 / (self.diagonal + prior_precision)).T.float().clone())

    def jacobian_variance(self, g: Tensor, a: Tensor | None, prior_precision: float) -> Tensor:
        inverse = 1.0 / (self.diagonal.to(g.dtype) + prior_precision)
        if a is None:
            g = g if g.dim() == 3 else g.sum(2)
            return torch.einsum("nco,o,ndo->ncd", g, inverse, g)
        if a.dim() == 2:
            spread = a.square() @ inverse.T  # (n, out)
            return torch.einsum("nco,no,ndo->ncd", g, spread, g)
        jacobian = torch.einsum("ncto,nti->ncoi", g, a)
        return torch.einsum("ncoi,oi,ndoi->ncd", jacobian, inverse, jacobian)

    def dense(self) -> Tensor:
        return torch.diag(self.diagonal.reshape(-1))

    @classmethod
    def head_statistics(cls, num_classes: int, width: int, device: torch.device | str) -> dict[str, Tensor]:
        return {"diagonal": torch.zeros(num_classes, width, dtype=FLOAT64, device=device)}

    @classmethod
    def accumulate(cls, statistics: dict[str, Tensor], phi_aug: Tensor, hessian: LossHessian) -> None:
        statistics["diagonal"] += hessian.diagonal().T @ phi_aug.to(FLOAT64).square()

    @classmethod
    def from_head_statistics(cls, statistics: dict[str, Tensor], num_data: int, bias: bool) -> DiagCurvature:
        return cls.from_diagonal(statistics["diagonal"])

    @classmethod
    def head_row_bytes(cls, num_classes: int, width: int, itemsize: int) -> int:
        return width * itemsize  # phĩ²
