"""The predictions of ``um.predict(x)``, one per kind of likelihood: :class:`Prediction` over classes and
:class:`RegressionPrediction` over real targets.

A classifier's :class:`Prediction` is a categorical: total predictive entropy splits into the expected entropy of the
samples (aleatoric) and the mutual information between prediction and parameters (epistemic):
``H[mean_s p_s] = mean_s H[p_s] + MI``.

A regressor's :class:`RegressionPrediction` is an equal-weight mixture of ``K`` Gaussians per example and output
(:class:`~posthoc.core.mixture.GaussianMixture`): component ``k`` has mean ``μ_k`` and variance ``m_k + s_k``, the
model's variance ``m_k`` plus the observation noise ``s_k``, so ``variance = aleatoric + epistemic`` with
``aleatoric = mean_k s_k`` and ``epistemic = mean_k m_k + mean_k (μ_k - μ)²``. An isotonic ``recalibration`` ``R`` of
its CDF (Kuleshov et al. 2018) reshapes ``cdf``, ``quantile``, ``interval`` and ``log_prob`` to ``R(F(y))`` exactly,
while the moments stay the uncalibrated mixture's (the recalibrated ones have no closed form).

Example:
    >>> import torch
    >>> from posthoc.core.prediction import RegressionPrediction
    >>> pred = RegressionPrediction.from_components(torch.tensor([[[1.0]], [[3.0]]]), None, torch.ones(2, 1, 1))
    >>> pred.mean, pred.aleatoric, pred.epistemic, pred.variance
    (tensor([[2.]]), tensor([[1.]]), tensor([[1.]]), tensor([[2.]]))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.mixture import GaussianMixture
from posthoc.core.recalibration import MonotoneMap
from posthoc.errors import InputError


def entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats, with ``0 log 0 = 0`` (safe at p = 0).

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import entropy
        >>> entropy(torch.tensor([1.0, 0.0])).item()
        0.0
    """
    return -torch.special.xlogy(probs, probs).sum(dim)


def softmax_entropy(probs: Tensor, log_probs: Tensor, confidence: Tensor, label: Tensor) -> Tensor:
    """:func:`entropy` over the last dim of ``probs = softmax(log_probs)`` with its ``(confidence, label) = probs.max(-1)``,
    with one product per class and no logarithm: ``log p = log_probs - lse`` where
    ``lse = log_probs[label] - log confidence``, so ``H = lse - Σ p log_probs``; rows this leaves NaN (a ``-inf``
    log-probability, ``0 · -inf``) are taken as :func:`entropy` does. (A BLAS dot would skip the product's
    temporary, but its sequential float32 sum loses ~1e-5 relative over 20,000 classes; this sum is pairwise.)

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import entropy, softmax_entropy
        >>> log_probs = torch.tensor([[0.0, 1.0, 2.0], [0.0, float("-inf"), 0.0]])
        >>> probs = log_probs.softmax(-1)
        >>> torch.allclose(softmax_entropy(probs, log_probs, *probs.max(-1)), entropy(probs))
        True
    """
    lse = log_probs.gather(-1, label[..., None])[..., 0] - confidence.log()
    total = (lse - torch.linalg.vecdot(probs, log_probs)).clamp_min_(0.0)
    bad = torch.isnan(total)
    if bool(bad.any()):
        total[bad] = entropy(probs[bad])
    return total


_PER_EXAMPLE = ("probs", "entropy", "aleatoric", "epistemic", "confidence", "label")


@dataclass(frozen=True)
class Prediction:
    """A predictive distribution over classes for a batch of ``N`` inputs.

    Attributes:
        probs: ``(N, C)`` predictive probabilities (the mean over samples when there are any).
        samples: ``(S, N, C)`` per-sample probabilities, or ``None`` for a deterministic predictive.
        entropy: ``(N,)`` total predictive entropy.
        aleatoric: ``(N,)`` expected entropy of the samples (equals ``entropy`` without samples).
        epistemic: ``(N,)`` mutual information, ``entropy - aleatoric`` (never below 0).
        confidence: ``(N,)`` largest class probability.
        label: ``(N,)`` the predicted class.
        sets: ``(N, C)`` boolean conformal prediction sets, or ``None`` (``posthoc.conformal(...).predict(x)``).
    """

    probs: Tensor
    samples: Tensor | None
    entropy: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    confidence: Tensor
    label: Tensor
    sets: Tensor | None = None

    @classmethod
    def from_probs(cls, probs: Tensor, samples: Tensor | None = None, log_probs: Tensor | None = None) -> Prediction:
        """Build a prediction from probabilities ``(N, C)`` and optional samples ``(S, N, C)``; ``log_probs``, when
        ``probs`` is their softmax, gives the entropy without a logarithm per class (:func:`softmax_entropy`).

        Example:
            >>> import torch
            >>> from posthoc.core.prediction import Prediction
            >>> samples = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
            >>> Prediction.from_probs(samples.mean(0), samples).epistemic
            tensor([0.6931])
        """
        confidence, label = probs.max(-1)
        total = entropy(probs) if log_probs is None else softmax_entropy(probs, log_probs, confidence, label)
        if samples is None:
            aleatoric = total
        else:
            aleatoric = entropy(samples).mean(0)
        epistemic = (total - aleatoric).clamp_min(0.0)
        return cls(probs, samples, total, aleatoric, epistemic, confidence, label)

    @classmethod
    def from_log_probs(cls, log_probs: Tensor, sample_log_probs: Tensor | None = None) -> Prediction:
        """Build a prediction from log-probabilities; samples, if given, are ``(S, N, C)``."""
        samples = None if sample_log_probs is None else sample_log_probs.exp()
        return cls.from_probs(log_probs.exp(), samples)

    @classmethod
    def empty_like(cls, part: Prediction, total: int, keep_samples: bool) -> Prediction:
        """Uninitialised outputs for ``total`` examples, shaped like chunk ``part``; fill with :meth:`write`."""

        def grow(tensor: Tensor, dim: int = 0) -> Tensor:
            shape = list(tensor.shape)
            shape[dim] = total
            return tensor.new_empty(shape)

        samples = grow(part.samples, 1) if keep_samples and part.samples is not None else None
        return cls(grow(part.probs), samples, *(grow(getattr(part, name)) for name in _PER_EXAMPLE[1:]))

    def write(self, start: int, part: Prediction) -> None:
        """Copy chunk ``part`` into examples ``start:start + len(part)`` of these outputs (what it already wrote there,
        as its ``probs``, is kept)."""
        stop = start + len(part)
        for name in _PER_EXAMPLE:
            into, value = getattr(self, name)[start:stop], getattr(part, name)
            if into.data_ptr() != value.data_ptr() or into.device != value.device:
                into.copy_(value)
        if self.samples is not None:
            self.samples[:, start:stop] = part.samples

    def __len__(self) -> int:
        return self.probs.shape[0]

    @property
    def num_classes(self) -> int:
        return self.probs.shape[-1]


@dataclass(frozen=True)
class RegressionPrediction:
    """A Gaussian (or equal-weight Gaussian mixture) predictive over targets for ``N`` inputs, ``D`` outputs.

    Attributes:
        mean: ``(N, D)`` predictive mean.
        variance: ``(N, D)`` predictive variance, ``aleatoric + epistemic``.
        std: ``(N, D)`` its square root.
        aleatoric: ``(N, D)`` the observation noise's share.
        epistemic: ``(N, D)`` the model's share (its posterior, its samples' or members' spread).
        samples: ``(S, N, D)`` the sampled networks' or members' means, or ``None`` for one Gaussian.
        distribution: the exact mixture.
        model_variances: ``(K, N, D)`` each component's model variance.
        noise: ``(K, N, D)`` each component's observation variance.
        recalibration: the isotonic map ``R`` applied to the mixture's CDF, or ``None`` (see module docs).
    """

    mean: Tensor
    variance: Tensor
    std: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    samples: Tensor | None
    distribution: GaussianMixture
    model_variances: Tensor
    noise: Tensor
    recalibration: MonotoneMap | None = None

    @classmethod
    def from_components(cls, means: Tensor, model_variances: Tensor | None, noise: Tensor) -> RegressionPrediction:
        """The prediction of ``K`` components: means ``(K, N, D)``, the model's variances ``(K, N, D)`` (``None``:
        points) and the observation variances ``noise`` (broadcast to ``(K, N, D)``)."""
        _check_components(means, model_variances, noise)
        noise = noise.expand_as(means)
        model = torch.zeros_like(means) if model_variances is None else model_variances
        aleatoric = noise.mean(0)
        epistemic = model.mean(0) + means.var(0, unbiased=False)
        variance = aleatoric + epistemic
        samples = means if means.shape[0] > 1 else None
        return cls(
            means.mean(0),
            variance,
            variance.sqrt(),
            aleatoric,
            epistemic,
            samples,
            GaussianMixture(means, model + noise),
            model,
            noise,
        )

    @property
    def recalibrated(self) -> bool:
        """Whether an isotonic recalibration reshapes the CDF (then ``mean`` and ``variance`` are the uncalibrated ones)."""
        return self.recalibration is not None

    def interval(self, level: float) -> tuple[Tensor, Tensor]:
        """``(lower, upper)`` ``(N, D)``: the central interval with probability ``level`` (e.g. 0.9)."""
        if self.recalibration is None:
            return self.distribution.interval(level)
        self.distribution.interval(level)  # the level's check
        return self.quantile((1 - level) / 2), self.quantile((1 + level) / 2)

    def quantile(self, q: float) -> Tensor:
        """``(N, D)``: the predictive ``q``-quantile per output (recalibrated: ``F⁻¹(R⁻¹(q))``)."""
        if self.recalibration is None:
            return self.distribution.quantile(q)
        self.distribution.quantile(q)  # the level's check
        levels = self.recalibration.inverse(torch.tensor(float(q), dtype=torch.float64, device=self.mean.device))
        tiny = torch.finfo(torch.float64).tiny
        return self.distribution.quantile_at(levels.clamp(tiny, 1 - 1e-16))

    def log_prob(self, y: Tensor) -> Tensor:
        """``(N,)``: the predictive log density of targets ``(N,)`` or ``(N, D)``, joint over the outputs
        (recalibrated: ``sum_d log R_d'(F_d(y_d)) + log f_d(y_d)``, ``-inf`` where ``R`` is flat)."""
        if self.recalibration is None:
            return self.distribution.log_prob(y)
        marginal = self.distribution.marginal_log_prob(y)
        slope = self.recalibration.slope(self.distribution.cdf(y)).to(marginal.dtype)
        return (marginal + slope.log()).sum(-1)

    def cdf(self, y: Tensor) -> Tensor:
        """``(N, D)``: the predictive CDF at targets ``y`` per output (recalibrated: ``R(F(y))``)."""
        if self.recalibration is None:
            return self.distribution.cdf(y)
        return self.recalibration(self.distribution.cdf(y)).to(self.mean.dtype)

    def scaled(self, scale: Tensor) -> RegressionPrediction:
        """The prediction with every output's spread multiplied by ``scale`` ``(D,)`` about its mean, exactly: component
        ``k`` moves to mean ``μ + s (μ_k - μ)`` and variance ``s² (m_k + s_k)``, the affine image ``μ + s (Y - μ)``.

        Example:
            >>> import torch
            >>> from posthoc.core.prediction import RegressionPrediction
            >>> pred = RegressionPrediction.from_components(torch.zeros(1, 2, 1), None, torch.ones(1, 1, 1))
            >>> pred.scaled(torch.tensor([2.0])).std
            tensor([[2.],
                    [2.]])
        """
        if self.recalibration is not None:
            raise InputError(
                "this prediction is already recalibrated (isotonic); scale the variance before recalibrating"
            )
        if (
            not isinstance(scale, Tensor)
            or tuple(scale.shape) not in ((self.num_outputs,), ())
            or not bool((torch.isfinite(scale) & (scale > 0)).all())
        ):
            shown = tuple(scale.shape) if isinstance(scale, Tensor) else type(scale).__name__
            raise InputError(
                f"scale must be a tensor of {self.num_outputs} finite factor(s) > 0, one per output (shape "
                f"({self.num_outputs},)), got {shown if not isinstance(scale, Tensor) or scale.numel() > 8 else scale}"
            )
        scale = scale.to(device=self.mean.device, dtype=self.mean.dtype)
        means = self.mean + scale * (self.component_means - self.mean)
        return RegressionPrediction.from_components(
            means, scale.square() * self.model_variances, scale.square() * self.noise
        )

    def recalibrate(self, mapping: MonotoneMap) -> RegressionPrediction:
        """The prediction whose CDF is ``mapping(F(y))`` (see module docs); refuses a second recalibration."""
        if self.recalibration is not None:
            raise InputError(
                "this prediction is already recalibrated (isotonic); recalibrate the uncalibrated prediction"
            )
        if mapping.knots_x.shape[0] != self.num_outputs:
            raise InputError(
                f"the recalibration maps {mapping.knots_x.shape[0]} output(s) but the prediction has "
                f"{self.num_outputs}; use a recalibration fitted for this model's outputs"
            )
        return dataclasses.replace(self, recalibration=mapping)

    @property
    def component_means(self) -> Tensor:
        """``(K, N, D)``: each component's mean."""
        return self.distribution.means

    def __len__(self) -> int:
        return self.mean.shape[0]

    @property
    def num_outputs(self) -> int:
        return self.mean.shape[-1]


def _check_components(means: Tensor, model_variances: Tensor | None, noise: Tensor) -> None:
    """Refuse components that are not tensors of the shapes :meth:`RegressionPrediction.from_components` reads."""
    if not isinstance(means, Tensor) or means.dim() != 3:
        shown = tuple(means.shape) if isinstance(means, Tensor) else type(means).__name__
        raise InputError(
            f"means must be a tensor (K, N, D) of K components for N examples and D outputs, got {shown}; "
            "a single Gaussian per example is means[None]"
        )
    if model_variances is not None and (
        not isinstance(model_variances, Tensor) or model_variances.shape != means.shape
    ):
        shown = tuple(model_variances.shape) if isinstance(model_variances, Tensor) else type(model_variances).__name__
        raise InputError(
            f"model_variances must be a tensor of the means' shape {tuple(means.shape)} (or None), got {shown}"
        )
    if not isinstance(noise, Tensor) or not _broadcasts(noise.shape, means.shape):
        shown = tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__
        raise InputError(
            f"noise must be a tensor of observation variances that broadcasts to the means' shape "
            f"{tuple(means.shape)}, got {shown}"
        )


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False


#: what a prediction is built from (:meth:`RegressionPrediction.from_components`), per component
COMPONENTS = ("component_means", "model_variances", "noise")


def concat(parts: list[RegressionPrediction], keep_samples: bool = True) -> RegressionPrediction:
    """The predictions of consecutive chunks of examples as one (``keep_samples=False`` drops ``samples``)."""
    joined = (
        parts[0]
        if len(parts) == 1
        else dataclasses.replace(
            RegressionPrediction.from_components(
                *(torch.cat([getattr(p, field) for p in parts], dim=1) for field in COMPONENTS)
            ),
            recalibration=parts[0].recalibration,
        )
    )
    return joined if keep_samples else dataclasses.replace(joined, samples=None)


def mix_predictions(parts: list[RegressionPrediction]) -> RegressionPrediction:
    """The equal-weight mixture of the members' predictions (each with the same number of components).

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import RegressionPrediction, mix_predictions
        >>> one = RegressionPrediction.from_components(torch.zeros(1, 2, 1), None, torch.ones(1, 1, 1))
        >>> mix_predictions([one, one]).samples.shape
        torch.Size([2, 2, 1])
    """
    if any(p.recalibrated for p in parts):
        raise InputError(
            "a recalibrated (isotonic) member prediction cannot be mixed exactly; mix the members first and "
            "recalibrate the mixture (stack 'isotonic-recalibration' after the ensemble)"
        )
    shapes = {tuple(p.distribution.means.shape) for p in parts}
    if len(shapes) > 1:
        raise InputError(
            f"the members predict different shapes (components, N, D): {sorted(shapes)}; every member must "
            "predict the same outputs for the same inputs, with the same number of samples"
        )
    return RegressionPrediction.from_components(
        *(torch.cat([getattr(p, field) for p in parts]) for field in COMPONENTS)
    )
