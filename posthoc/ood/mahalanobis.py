"""``"mahalanobis"``: distance to the closest class mean under a shared covariance (Lee et al., NeurIPS 2018); and
``"relative-mahalanobis"``.

Fit keeps float64 running sums only: per-class feature sums ``s_c`` and counts ``n_c``, and the Gram matrix. Then
``mu_c = s_c / n_c`` and the shared covariance is the pooled within-class scatter over ``N``, inverted with a
pseudo-inverse as in the paper's code. The score is ``min_c (phi - mu_c)^T Sigma^+ (phi - mu_c)`` over the classes
seen in training (the paper's confidence score negated; ``2 N`` times pytorch-ood's). A regressor has one "class", the
training features' mean.

``"relative-mahalanobis"`` (Ren et al., 2021) subtracts from each class's distance the distance under one Gaussian
fitted to all the training features (their mean and covariance, from the same sums): ``min_c d_c(phi) - d_0(phi)``,
``N`` times pytorch-ood's ``RMD`` (whose covariances are unnormalised scatters).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.mahalanobis import Mahalanobis
    >>> head = nn.Linear(16, 3)
    >>> features = torch.randn(64, 16)
    >>> outputs = Outputs(features=features, logits=head(features).detach(), head=head)   # one batch of the model
    >>> labels = torch.arange(64) % 3
    >>> score = Mahalanobis()
    >>> score.update(outputs, labels, 0); score.finish(0)
    >>> score(outputs).shape
    torch.Size([64])
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.ood.base import Outputs, Score


class Mahalanobis(Score):
    """Squared Mahalanobis distance of the head's input to the closest class mean."""

    name, uses, fit_passes, needs_labels = "mahalanobis", frozenset({"features"}), 1, True
    tasks = frozenset({"classification", "regression"})

    def reset(self) -> None:
        super().reset()
        self._counts: Tensor | None = None
        self._sums: Tensor | None = None
        self._gram: Tensor | None = None

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        features = outputs.features.detach().double()
        if self._counts is None:
            classes, width = outputs.head.out_features, features.shape[-1]
            self._counts = features.new_zeros(classes)
            self._sums = features.new_zeros(classes, width)
            self._gram = features.new_zeros(width, width)
        self._counts.index_add_(0, labels, features.new_ones(labels.shape[0]))
        self._sums.index_add_(0, labels, features)
        self._gram.addmm_(features.T, features)

    def finish(self, pass_index: int) -> None:
        counts, sums, gram = (distributed.all_reduce_sum(t) for t in (self._counts, self._sums, self._gram))
        self._counts = self._sums = self._gram = None
        self._fit(counts, sums, gram)
        self.fitted = True

    def _fit(self, counts: Tensor, sums: Tensor, gram: Tensor) -> None:
        """The class means and the shared precision from the per-class counts and sums and the Gram matrix."""
        present = counts > 0
        total = counts.sum()
        counts, sums = counts[present], sums[present]
        scatter = gram - (sums / counts[:, None]).T @ sums
        self.means = sums / counts[:, None]
        self.precision = torch.linalg.pinv(scatter / total, hermitian=True)
        self._means_precision = self.means @ self.precision
        self._means_norm = (self._means_precision * self.means).sum(-1)

    def class_distances(self, features: Tensor) -> Tensor:
        """The squared distances ``(N, C)`` in float64 of ``features`` to every class mean."""
        features = features.double()
        projected = features @ self.precision
        squared = (
            (projected * features).sum(-1, keepdim=True) - 2 * features @ self._means_precision.T + self._means_norm
        )
        return squared.clamp_min(0)

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        return self.class_distances(outputs.features).min(-1).values.to(outputs.features.dtype)


class RelativeMahalanobis(Mahalanobis):
    """The Mahalanobis distance to the closest class minus the distance under one Gaussian of all the features."""

    name, tasks = "relative-mahalanobis", frozenset({"classification"})

    def _fit(self, counts: Tensor, sums: Tensor, gram: Tensor) -> None:
        super()._fit(counts, sums, gram)
        total = counts.sum()
        self.background_mean = sums.sum(0) / total
        scatter = gram - total * torch.outer(self.background_mean, self.background_mean)
        self.background_precision = torch.linalg.pinv(scatter / total, hermitian=True)

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        centred = outputs.features.double() - self.background_mean
        background = ((centred @ self.background_precision) * centred).sum(-1)
        relative = self.class_distances(outputs.features) - background[:, None]
        return relative.min(-1).values.to(outputs.features.dtype)
