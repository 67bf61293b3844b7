"""The prior ladder scored from what is computed once: a rung is a small product over the held-out rows, not a predict.

The probit predictive of a linear head at prior precision ``δ`` reads the logits' means ``m`` and the diagonal of their
covariance, which every structure writes as prior-free factors of each input times a table of ``δ``
(:meth:`~posthoc.methods.laplace.structure.Curvature.head_factors` and ``head_spread``): for ``"kron-diag"``,
``(phĩ U)²`` summed in ``A``'s eigen-groups times ``1 / (λ g + δ)``, an ``(n, 48) @ (48, C)`` product. A
:class:`ProbitLadder` keeps each held-out row's factors, logits and label, made once; a rung makes the table, then in
row chunks under the memory budget the variances, the probit's scaled logits and, per row, the label's NLL, the top
probability and whether it is right: the :class:`~posthoc.engine.selection.Scores` a predict gives, without the rows'
``(N, C)`` log-probabilities and without the features' product with ``A``'s eigenvectors.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.kron_diag import KronDiagCurvature
    >>> from posthoc.methods.laplace.ladder import ProbitLadder
    >>> block = KronDiagCurvature.from_factors(torch.ones(3, dtype=torch.float64), torch.eye(5, dtype=torch.float64))
    >>> phi_aug, logits, labels = torch.ones(4, 5), torch.tensor([[2.0, 0.0, 0.0]]).repeat(4, 1), torch.zeros(4).long()
    >>> ladder = ProbitLadder(block, [(phi_aug, logits, labels)], [], row_bytes=64)
    >>> [round(float(ladder.scores(delta).clean[0]), 3) for delta in (1e8, 1.0)]  # wider: nearer uniform
    [0.24, 0.394]
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from posthoc.core.chunks import chunks
from posthoc.engine.runner import gather_rows
from posthoc.engine.selection import Scores
from posthoc.methods.laplace.structure import Curvature

#: one held-out batch as the ladder keeps it: prior-free variance factors, mean logits ``(n, C)``, labels ``(n,)``
Batch = tuple[Tensor, Tensor, Tensor]


class ProbitLadder:
    """The held-out :class:`Scores` of a head's probit predictive at any prior precision (module docs).

    ``clean`` and ``perturbed`` hold ``(phĩ, logits, labels)`` batches, reduced at once to :meth:`Curvature.head_factors`;
    ``row_bytes``: what one row keeps alive in a rung's chunk (the predictive's own figure).
    """

    def __init__(
        self, curvature: Curvature, clean: Iterable[Batch], perturbed: Iterable[Batch], *, row_bytes: int
    ) -> None:
        self.curvature = curvature
        self.row_bytes = row_bytes
        self.clean = self._kept(clean)
        self.perturbed = self._kept(perturbed)

    def _kept(self, batches: Iterable[Batch]) -> Batch | None:
        """The batches' factors, logits and labels, each joined into one tensor (``None`` for no batches)."""
        kept = []
        for phi_aug, logits, labels in batches:
            dtype = torch.promote_types(phi_aug.dtype, torch.float32)
            kept.append((self.curvature.head_factors(phi_aug.to(dtype)), logits.to(dtype), labels.long()))
        return tuple(torch.cat(parts) for parts in zip(*kept)) if kept else None  # type: ignore[return-value]

    def scores(self, prior_precision: float) -> Scores:
        """The :class:`Scores` of the probit predictive at ``prior_precision`` on the clean and perturbed rows."""
        nll, _, correct = self._rows(self.clean, prior_precision)
        if self.perturbed is None:
            return Scores(nll, mistakes=1 - correct)
        return Scores(nll, *self._rows(self.perturbed, prior_precision), mistakes=1 - correct)

    def _rows(self, batch: Batch, prior_precision: float) -> tuple[Tensor, Tensor, Tensor]:
        """Per row of ``batch`` (gathered over ranks): NLL, top probability and correctness, float64."""
        factors, mean, labels = batch
        spread = self.curvature.head_spread(prior_precision, mean.dtype)
        nll, log_top, correct = [], [], []
        for rows in chunks(len(labels), self.row_bytes):
            scaled = spread(factors[rows], mean[rows]).mul_(math.pi / 8).add_(1).rsqrt_().mul_(mean[rows])
            normaliser = torch.logsumexp(scaled, dim=-1)
            top, predicted = scaled.max(dim=-1)
            nll.append(normaliser - scaled.gather(-1, labels[rows, None]).squeeze(-1))
            log_top.append(top - normaliser)
            correct.append(predicted == labels[rows])
        nll_rows, log_top_rows, correct_rows = (
            gather_rows(torch.cat(parts).double()) for parts in (nll, log_top, correct)
        )
        return nll_rows, log_top_rows.exp(), correct_rows
