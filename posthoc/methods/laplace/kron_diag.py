"""``hessian="kron-diag"``: KFAC with a diagonal output factor, ``diag(g) ⊗ A``, for heads with many classes.

KFAC's ``C x C`` output factor is too large for tens of thousands of classes; this keeps its exact diagonal ``g``,
and ``A = U diag(λ) Uᵀ``. The GGN's eigenvalues are ``g_c λ_i``, and the logits are independent with variances
``Σ_i ψ_i² / (λ_i g_c + δ)``, ``ψ = Uᵀ phĩ``: a ``(D+1) x C`` product per input, as costly as the head. So the
predictive groups ``A``'s eigenvalues (:func:`eigen_groups`): the largest ``EXACT_DIRECTIONS`` alone, the rest in
``GROUPS`` bins even in ``log λ`` at their mean, each bin's ``1/(λ g + δ)`` varying by less than its eigenvalues'
spread. ``groups = None`` on a block gives the exact sum.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.kron_diag import KronDiagCurvature
    >>> block = KronDiagCurvature.from_factors(torch.ones(3, dtype=torch.float64), torch.eye(5, dtype=torch.float64))
    >>> block.spectrum().shape, block.head_variance(torch.ones(2, 5), torch.zeros(2, 3), 1.0).variance()
    (torch.Size([15]), tensor([[2.5000, 2.5000, 2.5000], [2.5000, 2.5000, 2.5000]]))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import LossHessian
from posthoc.errors import ConfigError
from posthoc.export.modules import cast
from posthoc.methods.laplace.glm_predictive import IndependentLogits
from posthoc.methods.laplace.structure import FLOAT64, Curvature, clamp_curvature, symmetric_eig

#: the largest eigenvalues of ``A`` that the predictive keeps each on its own
EXACT_DIRECTIONS = 16
#: bins, even in ``log λ``, that the rest of ``A``'s eigenvalues share
GROUPS = 32
#: eigenvalues below this fraction of the largest share the last bin (they are at the prior for any sane ``g δ``)
LOG_RANGE = 1e-8


def eigen_groups(eigvals: Tensor, exact: int = EXACT_DIRECTIONS, bins: int = GROUPS) -> tuple[Tensor, Tensor]:
    """``(membership (W, K), means (K,))``: each eigenvalue of ``A``'s group, and each group's mean (empty bins dropped).

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.kron_diag import eigen_groups
        >>> membership, means = eigen_groups(torch.tensor([1e-7, 1e-7, 0.5, 4.0], dtype=torch.float64), 1, 2)
        >>> membership.sum(0).tolist(), means.tolist()
        ([1.0, 1.0, 2.0], [4.0, 0.5, 1e-07])
    """
    width = eigvals.shape[0]
    order = torch.argsort(eigvals, descending=True)
    exact = min(exact, width)
    label = torch.empty(width, dtype=torch.long, device=eigvals.device)
    label[order[:exact]] = torch.arange(exact, device=eigvals.device)
    rest = order[exact:]
    if rest.numel():
        top = float(eigvals[rest[0]].clamp_min(torch.finfo(FLOAT64).tiny))
        floor = top * LOG_RANGE
        position = torch.log(eigvals[rest].clamp_min(floor) / floor) / math.log(top / floor)  # 0 (floor) .. 1 (top)
        label[rest] = exact + (bins - 1 - (position * bins).floor().long().clamp(0, bins - 1))
    used, label = torch.unique(label, return_inverse=True)
    membership = torch.zeros(width, used.shape[0], dtype=eigvals.dtype, device=eigvals.device)
    membership[torch.arange(width, device=eigvals.device), label] = 1.0
    means = (eigvals @ membership) / membership.sum(0)
    return membership, means


class FoldedKronDiag(nn.Module):
    """The exported :meth:`KronDiagCurvature.head_variance`: ``s² = ((phĩ U)² @ membership) @ inverse``."""

    def __init__(self, in_eigvecs: Tensor, membership: Tensor, inverse: Tensor) -> None:
        super().__init__()
        self.register_buffer("in_eigvecs", in_eigvecs)
        self.register_buffer("membership", membership)
        self.register_buffer("inverse", inverse)

    def forward(self, phi_aug: Tensor, mean: Tensor) -> IndependentLogits:
        dtype = phi_aug.dtype
        summed = (phi_aug @ cast(self.in_eigvecs, dtype)).square() @ cast(self.membership, dtype)
        return IndependentLogits(mean, summed @ cast(self.inverse, dtype))


class KronDiagCurvature(Curvature):
    """``diag(g) ⊗ A``, last layer only; ``groups``: ``(exact, bins)`` of :func:`eigen_groups`, ``None``: exact."""

    fields = ("out_diagonal", "in_eigvals", "in_eigvecs")

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.groups: tuple[int, int] | None = (EXACT_DIRECTIONS, GROUPS)

    @classmethod
    def from_factors(cls, out_diagonal: Tensor, in_factor: Tensor, name: str = "") -> KronDiagCurvature:
        """The block of the output factor's diagonal ``g`` ``(C,)`` and the input factor ``A`` ``(W, W)``."""
        block = cls(name)
        of = f" of {name}" if name else " of the GGN"
        block.out_diagonal = clamp_curvature(out_diagonal.clone(), f"output factor diagonal{of}")
        block.in_eigvals, block.in_eigvecs = symmetric_eig(in_factor, f"input factor A{of}")
        return block

    @classmethod
    def from_sums(cls, sums: list[Tensor], count: int, name: str = "") -> KronDiagCurvature:
        raise ConfigError(
            "hessian='kron-diag' is a last-layer structure (subset='last_layer'); over several layers use 'kron' or 'diag'"
        )

    def spectrum(self) -> Tensor:
        return torch.outer(self.out_diagonal, self.in_eigvals).reshape(-1)

    def correlate(self, noise: Tensor, prior_precision: float) -> Tensor:
        dtype, count = noise.dtype, noise.shape[0]
        scale = torch.rsqrt(torch.outer(self.out_diagonal, self.in_eigvals) + prior_precision).to(dtype)
        matrix = noise.reshape(count, self.out_diagonal.shape[0], -1) * scale
        return matrix @ self.in_eigvecs.T.to(dtype)

    def _grouped(self, prior_precision: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(membership (W, K), inverse (K, C))`` in ``dtype``: the identity and the exact inverse without groups."""
        if self.groups is None:
            membership, means = (
                torch.eye(self.in_eigvals.shape[0], dtype=dtype, device=self.in_eigvals.device),
                (self.in_eigvals),
            )
        else:
            membership, means = eigen_groups(self.in_eigvals, *self.groups)
        inverse = torch.outer(means.to(dtype), self.out_diagonal.to(dtype)).add_(prior_precision).reciprocal_()
        return membership.to(dtype), inverse

    def head_variance(self, phi_aug: Tensor, mean: Tensor, prior_precision: float) -> IndependentLogits:
        return self.head_predictor(prior_precision, phi_aug.dtype)(phi_aug, mean)

    def head_predictor(
        self, prior_precision: float, dtype: torch.dtype
    ) -> Callable[[Tensor, Tensor], IndependentLogits]:
        """:meth:`head_variance` with the groups, their ``(K, C)`` inverse and ``U`` made once in ``dtype``."""
        in_eigvecs = self.in_eigvecs.to(dtype)
        membership, inverse = self._grouped(prior_precision, dtype)

        def gaussian(phi_aug: Tensor, mean: Tensor) -> IndependentLogits:
            psi_sq = (phi_aug @ in_eigvecs).square_()
            summed = psi_sq if self.groups is None else psi_sq @ membership
            return IndependentLogits(mean.to(dtype), summed @ inverse)

        return gaussian

    def head_factors(self, phi_aug: Tensor) -> Tensor:
        """``(phĩ U)²`` summed over each group of ``A``'s eigenvalues, ``(n, K)`` (``K = D + 1`` without groups)."""
        psi_sq = (phi_aug @ self.in_eigvecs.to(phi_aug.dtype)).square_()
        return psi_sq if self.groups is None else psi_sq @ eigen_groups(self.in_eigvals, *self.groups)[0].to(psi_sq)

    def head_spread(self, prior_precision: float, dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor]:
        inverse = self._grouped(prior_precision, dtype)[1]
        return lambda factors, mean: factors @ inverse

    def fold_head(self, prior_precision: float, classes: int, width: int) -> FoldedKronDiag:
        membership, inverse = self._grouped(prior_precision, torch.float64)
        return FoldedKronDiag(self.in_eigvecs.float().clone(), membership.float(), inverse.float())

    def jacobian_variance(self, g: Tensor, a: Tensor | None, prior_precision: float) -> Tensor:
        raise ConfigError("hessian='kron-diag' is a last-layer structure (subset='last_layer')")

    def dense(self) -> Tensor:
        in_factor = self.in_eigvecs @ torch.diag(self.in_eigvals) @ self.in_eigvecs.T
        return torch.kron(torch.diag(self.out_diagonal), in_factor)

    @classmethod
    def head_statistics(cls, num_classes: int, width: int, device: torch.device | str) -> dict[str, Tensor]:
        return {
            "out_diagonal": torch.zeros(num_classes, dtype=FLOAT64, device=device),
            "in_factor": torch.zeros(width, width, dtype=FLOAT64, device=device),
        }

    @classmethod
    def accumulate(cls, statistics: dict[str, Tensor], phi_aug: Tensor, hessian: LossHessian) -> None:
        statistics["out_diagonal"] += hessian.diagonal().sum(0)
        statistics["in_factor"] += (phi_aug.T @ phi_aug).to(FLOAT64)

    @classmethod
    def from_head_statistics(cls, statistics: dict[str, Tensor], num_data: int, bias: bool) -> KronDiagCurvature:
        in_factor = statistics["in_factor"] / num_data
        if bias:  # as KFAC: the bias is its own block g ⊗ 1
            in_factor[-1, :-1] = 0
            in_factor[:-1, -1] = 0
        return cls.from_factors(statistics["out_diagonal"], in_factor)

    @classmethod
    def head_row_bytes(cls, num_classes: int, width: int, itemsize: int) -> int:
        return 2 * width * itemsize  # phĩ U and its square (the groups' sums are far smaller)
