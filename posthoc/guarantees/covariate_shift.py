"""Conformal sets under covariate shift: calibration scores weighted by an estimated likelihood ratio.

When deployment inputs follow another law than the calibration inputs, but ``p(y | x)`` is the same (covariate
shift), split conformal sets lose their guarantee. Weighted conformal prediction (Tibshirani, Barber, Candès &
Ramdas, "Conformal Prediction Under Covariate Shift", NeurIPS 2019) restores it with the likelihood ratio
``w(x) = dP_deploy / dP_calib (x)``: a test point ``x``'s threshold is the ``1 - alpha`` quantile of

    ``sum_i p_i(x) delta_{s_i} + p_test(x) delta_{+inf}``,  ``p_i(x) = w(X_i) / (sum_j w(X_j) + w(x))``,
    ``p_test(x) = w(x) / (sum_j w(X_j) + w(x))``,

so calibration examples that look like deployment inputs count more, and a test point unlike any of them (its own
weight large) gets a large set. With the true ratio the set covers with probability at least ``1 - alpha`` under the
deployment law.

The ratio is estimated by a domain classifier: a logistic regression (scikit-learn's, Newton steps, on standardised
features)
tells calibration features from unlabelled deployment features, and ``w(x) = P(deploy | x) / P(calib | x) * n_calib /
n_deploy``. The features are the model's own: the input of its classifier head. Estimated ratios can be extreme, so
they are clipped at ``max_weight``, and the calibration weights' effective sample size ``(sum w)^2 / sum w^2``
(Kish) says how many calibration examples the weighted quantile effectively rests on: far below ``n``, the shift is
strong and the sets are wide or unstable.

Example:
    >>> import torch
    >>> import posthoc
    >>> g = torch.Generator().manual_seed(0)
    >>> feats = torch.randn(1500, 2, generator=g, dtype=torch.float64)
    >>> logits = 3 * feats @ torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.0, -1.0]], dtype=torch.float64)
    >>> labels = torch.distributions.Categorical(logits=logits).sample()
    >>> deploy = torch.randn(500, 2, generator=g, dtype=torch.float64) + 1.0       # shifted inputs, no labels
    >>> cp = posthoc.conformal(logits[:1000], labels[:1000], alpha=0.1, features=feats[:1000], shift_features=deploy)
    >>> cp.sets(logits[1000:], features=feats[1000:]).shape
    torch.Size([500, 3])
    >>> 100 < cp.effective_sample_size < 1000
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posthoc.core.checks import positive_number
from posthoc.core.inputs import Inputs, iterate, like_given, looks_like_loader, to_device
from posthoc.core.modules import eval_mode
from posthoc.core.prediction import Prediction
from posthoc.engine.head import FeatureSplit
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.bounds import RANK_TOLERANCE
from posthoc.guarantees.set_predictor import ConformalPredictor

#: the default cap of an estimated likelihood ratio (the calibration mean of the ratio is about 1)
MAX_WEIGHT = 20.0


@torch.no_grad()
def model_features(um: UncertainModel, data: Any, *, progress: bool = False) -> tuple[Tensor, Tensor | None]:
    """The input of ``um``'s classifier head for inputs ``x`` or a loader of batches, float64 on the CPU, with the
    loader's labels if it has them (``None`` otherwise)."""
    model = um.method.base_model
    split = FeatureSplit(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batches = (
        iterate(data, device=device, progress=progress, require_labels=False, desc="features for the shift")
        if looks_like_loader(data)
        else [(to_device(data, device), None)]
    )
    features, labels = [], []
    with eval_mode(model):
        for x, y in batches:
            features.append(split(x)[0].detach().double().cpu())
            labels.append(None if y is None else torch.as_tensor(y).reshape(-1).cpu())
    return torch.cat(features), None if any(y is None for y in labels) else torch.cat(labels)


class LikelihoodRatio:
    """``w(x) = dP_deploy / dP_calib``, estimated by a logistic domain classifier (module docs), clipped at
    ``max_weight``. ``ratio(features)`` gives the weights ``(N,)`` in float64."""

    def __init__(self, source: Tensor, target: Tensor, *, max_weight: float | None = MAX_WEIGHT, seed: int = 0) -> None:
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        if source.shape[1] != target.shape[1]:
            raise InputError(
                f"the deployment features have {target.shape[1]} columns but the calibration features "
                f"{source.shape[1]}: pass features of the same model (the input of its head) for both"
            )
        x = torch.cat([source, target]).numpy()
        domain = np.r_[np.zeros(len(source)), np.ones(len(target))]
        self.classifier = make_pipeline(
            StandardScaler(), LogisticRegression(solver="newton-cholesky", max_iter=100, random_state=seed)
        )
        self.classifier.fit(x, domain)
        self.prior_odds = len(source) / len(target)
        self.max_weight = max_weight

    def log_odds(self, features: Tensor) -> Tensor:
        """``log P(deploy | x) - log P(calib | x)`` ``(N,)`` from the domain classifier."""
        return torch.from_numpy(self.classifier.decision_function(features.numpy())).double()

    def __call__(self, features: Tensor) -> Tensor:
        weights = self.log_odds(features).exp() * self.prior_odds
        return weights if self.max_weight is None else weights.clamp_max(self.max_weight)


def effective_sample_size(weights: Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2``: ``n`` for equal weights, less the more they differ.

    Example:
        >>> import torch
        >>> from posthoc.guarantees.covariate_shift import effective_sample_size
        >>> effective_sample_size(torch.ones(10)), effective_sample_size(torch.tensor([1.0, 0.0, 0.0]))
        (10.0, 1.0)
    """
    return float(weights.sum() ** 2 / (weights**2).sum())


def weighted_thresholds(sorted_scores: Tensor, sorted_weights: Tensor, test_weights: Tensor, alpha: float) -> Tensor:
    """Each test point's threshold ``(M,)``: the ``1 - alpha`` quantile of the calibration scores ``(n,)`` (sorted,
    with their weights) and ``+inf`` weighted by the test point's own weight (module docs); ``inf`` where the
    calibration mass never reaches ``1 - alpha``. With equal weights it is the split conformal threshold.

    Example:
        >>> import torch
        >>> from posthoc.guarantees.covariate_shift import weighted_thresholds
        >>> scores = torch.arange(1.0, 10.0, dtype=torch.float64)             # 9 scores, alpha 0.1: the 9th
        >>> weighted_thresholds(scores, torch.ones(9, dtype=torch.float64), torch.tensor([1.0, 0.5, 3.0]), 0.1)
        tensor([9., 9., inf], dtype=torch.float64)
    """
    cumulative = sorted_weights.cumsum(0)
    needed = (1 - alpha) * (cumulative[-1] + test_weights) * (1 - RANK_TOLERANCE)
    k = torch.searchsorted(cumulative, needed)
    padded = torch.cat([sorted_scores, sorted_scores.new_full((1,), torch.inf)])
    return padded[k.clamp_max(len(sorted_scores))]


class WeightedConformalPredictor(ConformalPredictor):
    """Conformal sets weighted for a covariate shift (module docs); build with ``posthoc.conformal(...,
    shift_loader=...)`` or ``shift_features=``. Each test point has its own threshold, so :meth:`sets` needs the test
    points' features: computed from inputs ``x`` for a wrapped model, passed as ``features=`` with arrays.

    ``weights`` are the calibration examples' clipped ratios, ``effective_sample_size`` their Kish size and
    ``clipped`` how many reached ``max_weight``."""

    def __init__(
        self,
        base: ConformalPredictor,
        true_scores: Tensor,
        weights: Tensor,
        ratio: LikelihoodRatio,
    ) -> None:
        super().__init__(
            base.predictive,
            base.score,
            base.alpha,
            base.threshold,
            "shift",
            base.num_calibration,
            non_empty=base.non_empty,
        )
        order = true_scores.argsort()
        self.sorted_scores, self.sorted_weights, self.ratio, self.weights = (
            true_scores[order],
            weights[order],
            ratio,
            weights,
        )
        self.effective_sample_size = effective_sample_size(weights)
        self.clipped = 0 if ratio.max_weight is None else int((weights >= ratio.max_weight).sum())

    def thresholds(self, features: Tensor) -> Tensor:
        """The threshold ``(N,)`` of each test point from its features ``(N, D)``."""
        return weighted_thresholds(self.sorted_scores, self.sorted_weights, self.ratio(features), self.alpha)

    def sets(self, data: Any, features: Any = None) -> Tensor:
        """Boolean sets ``(N, C)`` for ``data`` as in :meth:`ConformalPredictor.sets`; ``features`` ``(N, D)`` of the
        same points (the input of the model's head), needed unless ``data`` are a wrapped model's inputs."""
        probs = self.predictive(data).probs
        if features is None:
            if self.predictive.kind != "model" or isinstance(data, Prediction):
                raise InputError(
                    "weighted conformal sets need each test point's features: pass features=... (the input of the "
                    "model's head, as at calibration), or the model's inputs x when calibrated on a wrapped model"
                )
            features = model_features(self.model, data)[0]
        features = as_features(features, "features")
        if len(features) != len(probs):
            raise InputError(f"got {len(probs)} test points but {len(features)} rows of features; pass one per point")
        threshold = self.thresholds(features)[:, None].to(probs.device)
        return like_given(self._sets(probs, threshold), data)

    def predict(self, x: Inputs) -> Prediction:
        """The wrapped model's :class:`Prediction` for inputs ``x``, with ``.sets`` filled (weighted by ``x``'s
        features)."""
        if self.predictive.kind != "model":
            raise ConfigError(
                "predict(x) needs a conformal predictor calibrated on a wrapped model; use sets(probs, features=...) "
                "for arrays"
            )
        pred = self.predictive(x)
        return dataclasses.replace(pred, sets=self.sets(pred, features=model_features(self.model, x)[0]))

    def coverage(self, data: Any, labels: Any, features: Any = None) -> dict[str, float]:
        """As :meth:`ConformalPredictor.coverage`, with the test points' ``features`` (see :meth:`sets`)."""
        return self._coverage(self.sets(data, features), labels)

    def __repr__(self) -> str:
        return (
            f"WeightedConformalPredictor(score={self.score.describe()}, alpha={self.alpha:g}, n={self.num_calibration}, "
            f"effective_sample_size={self.effective_sample_size:.1f}, clipped={self.clipped})"
        )


def as_features(values: Any, what: str) -> Tensor:
    """``values`` ``(N, D)`` (tensor or numpy) as finite float64 on the CPU."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not isinstance(values, Tensor) or values.dim() != 2 or not values.is_floating_point():
        raise InputError(
            f"{what} must be a float tensor or numpy array (N, D), one row of features per point, got "
            f"{tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__}"
        )
    if not bool(torch.isfinite(values).all()):
        raise InputError(f"{what} contain NaN or inf")
    return values.detach().double().cpu()


def weighted_conformal(
    base: ConformalPredictor,
    true_scores: Tensor,
    *,
    source: Any,
    calibration: Any,
    labels: Tensor,
    features: Any,
    shift_loader: Iterable | None,
    shift_features: Any,
    max_weight: float | None,
    seed: int,
    progress: bool,
) -> WeightedConformalPredictor:
    """Weight ``base``'s calibration for the deployment data (called by ``posthoc.conformal``): the calibration and
    deployment features from the wrapped ``source`` and its loaders, or from ``features`` and ``shift_features``."""
    if max_weight is not None:
        max_weight = positive_number(max_weight, "max_weight", why="the cap of a likelihood ratio")
    if isinstance(source, UncertainModel):
        if shift_loader is None or features is not None or shift_features is not None:
            raise ConfigError(
                "calibrated on a wrapped model, the deployment data is an unlabelled loader, shift_loader=...; "
                "features= and shift_features= are for arrays of probabilities or logits"
            )
        features, seen = model_features(source, calibration, progress=progress)
        if seen is not None and not torch.equal(seen, labels):
            raise InputError(
                "the calibration loader gave its batches in another order on a second pass (it shuffles): weighted "
                "conformal reads it twice (predictions, then features); pass a loader with shuffle=False"
            )
        target = model_features(source, shift_loader, progress=progress)[0]
    else:
        if shift_loader is not None or features is None or shift_features is None:
            raise ConfigError(
                "calibrated on probabilities or logits, the shift takes the calibration points' features= and the "
                "deployment points' shift_features= (the input of the model's head); shift_loader= is for a "
                "wrapped model: posthoc.conformal(um, calibration_loader, shift_loader=unlabelled_loader)"
            )
        features = as_features(features, "features")
        target = as_features(shift_features, "shift_features")
        if len(features) != len(true_scores):
            raise InputError(
                f"got {len(true_scores)} calibration examples but {len(features)} rows of features; pass one per example"
            )
    ratio = LikelihoodRatio(features, target, max_weight=max_weight, seed=seed)
    return WeightedConformalPredictor(base, true_scores, ratio(features), ratio)
