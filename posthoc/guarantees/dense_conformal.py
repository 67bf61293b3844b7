"""Conformal prediction sets per position for a dense model (``posthoc.conformal(um, loader)`` on
``posthoc.wrap(model, dense=True)``): a set of classes at every pixel (token).

What holds. The positions of one image are not exchangeable with each other (neighbouring pixels share their errors),
but the images are. Each calibration image ``i`` gives its valid positions' scores (the ignore index left out), and
``F_i(t)`` is the fraction of them at most ``t``. The threshold is the smallest calibration score ``t`` with
``sum_i F_i(t) >= (n + 1)(1 - alpha)`` over the ``n`` calibration images that have a valid position: the scores of all
images pooled, each position weighted by one over its image's count of valid positions (every image weighs one). Then,
for a new image exchangeable with the calibration images, the **expected fraction of its valid positions whose set
holds the label is at least** ``1 - alpha`` (over the calibration images and the new one); for continuous scores it is
at most ``1 - alpha + 2/(n + 1)``. Proof: ``sum_{i<=n} F_i(t) >= sum_{i<=n+1} F_i(t) - 1``, so ``t`` is at least the
threshold ``t*`` computed the same way from all ``n + 1`` images at level ``(n + 1)(1 - alpha)``, which is symmetric in
them: ``E[F_{n+1}(t)] >= E[F_{n+1}(t*)] = E[sum_i F_i(t*)] / (n + 1) >= 1 - alpha``. It is a guarantee on the mean over a
new image's positions, not on each position: within one image some regions (object boundaries) are covered less often
than others, and one image's coverage varies around the mean. When every image has ``m`` valid positions the threshold
is the ``ceil((n + 1)(1 - alpha) m)``-th smallest of the ``n·m`` pooled scores. The sample size is the number of
images: ``n >= 1/alpha - 1`` of them, however many pixels each has.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import posthoc
    >>> model = nn.Conv2d(1, 3, 1)                                    # logits (N, 3, H, W)
    >>> images, masks = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40, 8, 8))
    >>> um = posthoc.wrap(model, method="none", dense=True).fit(None, [(images[:20], masks[:20])], progress=False)
    >>> cp = posthoc.conformal(um, [(images[:20], masks[:20])], alpha=0.1)
    >>> sets = cp.sets(images[20:])                                   # bool (N, 3, 8, 8), like the probabilities
    >>> tuple(sets.shape), cp.num_calibration
    ((20, 3, 8, 8), 20)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import probability
from posthoc.core.inputs import Inputs, looks_like_loader, split_batch
from posthoc.core.prediction import Prediction
from posthoc.engine.dense import valid_labels
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.bounds import RANK_TOLERANCE, conformal_rank
from posthoc.guarantees.scores import ConformityScore


def image_threshold(scores: Tensor, images: Tensor, alpha: float) -> Tensor:
    """The smallest of ``scores`` ``(M,)`` (one per valid position; ``images`` ``(M,)`` its image's index) at which
    the images' fractions of positions at most it sum to ``(n + 1)(1 - alpha)`` over the ``n`` images (module docs).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.dense_conformal import image_threshold
        >>> scores = torch.arange(40.0)                                 # 10 images of 4 positions each
        >>> float(image_threshold(scores, torch.arange(10).repeat_interleave(4), alpha=0.2))   # ceil(11·0.8·4) = 36th
        35.0
    """
    _, index, counts = torch.unique(images, return_inverse=True, return_counts=True)
    count = len(counts)
    conformal_rank(count, alpha)  # refuses fewer than 1/alpha - 1 images
    order = scores.argsort()
    mass = (1.0 / counts.double())[index][order].cumsum(0)
    level = (count + 1) * (1.0 - alpha) - RANK_TOLERANCE * (count + 1)
    at = min(int(torch.searchsorted(mass, torch.tensor([level], dtype=mass.dtype))), len(scores) - 1)
    return scores[order][at]


class DenseConformalPredictor:
    """Fitted per-position conformal sets of a dense model; build with ``posthoc.conformal(um, loader)`` (module
    docs). ``threshold`` is a 0-dim tensor; ``num_calibration`` counts images, ``num_positions`` their valid
    positions."""

    def __init__(
        self,
        model: Any,
        score: ConformityScore,
        alpha: float,
        threshold: Tensor,
        num_calibration: int,
        num_positions: int,
        generator: torch.Generator,
    ) -> None:
        self.model, self.score, self.alpha, self.threshold = model, score, alpha, threshold
        self.num_calibration, self.num_positions, self.generator = num_calibration, num_positions, generator
        self.mondrian = False

    def sets(self, data: Prediction | Inputs) -> Tensor:
        """Boolean sets shaped like the probabilities, ``(N, C, *P)`` (tokens ``(N, T, V)``): ``True`` where a
        class is in the set of its position; for the dense model's :class:`~posthoc.Prediction` or its inputs."""
        probs = (data if isinstance(data, Prediction) else self.model.predict(data, generator=self.generator)).probs
        dim = self.model.position_rows[0].class_dim
        rows = probs.movedim(dim, -1)
        inside = self.score(rows.reshape(-1, rows.shape[-1])) <= self.threshold.to(probs.device)
        return inside.reshape(rows.shape).movedim(-1, dim)

    def predict(self, x: Inputs) -> Prediction:
        """The dense model's :class:`~posthoc.Prediction` for ``x``, with ``.sets`` filled (:meth:`sets`)."""
        pred = self.model.predict(x, generator=self.generator)
        return dataclasses.replace(pred, sets=self.sets(pred))

    def intervals(self, data: Any) -> tuple[Tensor, Tensor]:
        """Refused: a dense classifier's conformal output is a set of classes per position, :meth:`sets`."""
        raise ConfigError("conformal intervals are for regressors; this dense model is a classifier: use cp.sets(x)")

    def __repr__(self) -> str:
        return (
            f"DenseConformalPredictor(score={self.score.describe()}, alpha={self.alpha:g}, "
            f"threshold={float(self.threshold):.4g}, images={self.num_calibration}, positions={self.num_positions})"
        )


def conformal_dense(
    model: Any,
    loader: Iterable,
    *,
    alpha: float,
    score: str | None,
    randomized: bool | None,
    k_reg: int | None,
    lam: float | None,
    mondrian: bool,
    seed: int,
    **_: Any,
) -> DenseConformalPredictor:
    """Calibrate per-position sets of the dense ``model`` on ``loader`` of ``(inputs, labels per position)``
    (called by ``posthoc.conformal`` for a dense model; its arguments; the guarantee in the module docs)."""
    alpha = probability(alpha, "alpha")
    if model.regression:
        raise ConfigError(
            "conformal intervals per position (a per-pixel regressor) are not supported yet; conformal sets per "
            "position take a dense classifier"
        )
    if mondrian:
        raise ConfigError(
            "mondrian=True (one threshold per class) is not supported for dense models: a class's positions are "
            "not exchangeable units; use mondrian=False, whose guarantee is per image (posthoc.guarantees."
            "dense_conformal)"
        )
    if not looks_like_loader(loader):
        raise InputError(
            f"a dense model is calibrated on a loader of (inputs, labels per position) batches, not "
            f"{type(loader).__name__}: posthoc.conformal(um, calibration_loader)"
        )
    conformity = ConformityScore(
        "lac" if score is None else score,
        randomized=randomized,
        k_reg=k_reg,
        lam=lam,
        generator=torch.Generator().manual_seed(seed),
    )
    generator = torch.Generator(device=model.inner.device).manual_seed(seed)
    dim = model.position_rows[0].class_dim
    scores, images, seen = [], [], 0
    for batch in loader:
        x, y = split_batch(batch)
        probs = model.predict(x, generator=generator).probs.movedim(dim, -1).cpu()
        keep, labels = valid_labels(y.cpu(), probs.shape[-1], model.ignore_index)
        if keep.shape != probs.shape[:-1]:
            raise InputError(
                f"labels {tuple(y.shape)} do not match the dense probabilities {tuple(probs.movedim(-1, dim).shape)}:"
                " pass labels with the probabilities' shape less the class dimension"
            )
        true = conformity(probs[keep]).gather(1, labels[:, None].long()).squeeze(1)
        scores.append(true)
        index = torch.arange(seen, seen + len(y)).view(-1, *([1] * (keep.dim() - 1))).expand_as(keep)
        images.append(index[keep])
        seen += len(y)
    scores_all, images_all = torch.cat(scores), torch.cat(images)
    if not len(scores_all):
        raise InputError("every calibration position is the ignore index: no label to calibrate on")
    threshold = image_threshold(scores_all, images_all, alpha)
    count = len(torch.unique(images_all))
    return DenseConformalPredictor(model, conformity, alpha, threshold, count, len(scores_all), generator)
