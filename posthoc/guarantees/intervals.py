"""Split conformal intervals for regression: a band around any point or interval prediction with a coverage guarantee.

Calibration scores ``n`` held-out examples, keeps the ``ceil((n + 1)(1 - alpha))``-th smallest score ``t`` per
output, and widens each test prediction by it. If calibration and test examples are exchangeable, each output's
interval holds its target with probability at least ``1 - alpha``. The score follows from what the predictions carry:

- ``"absolute"`` (a mean): ``|y - mean|``, intervals ``mean -+ t``: one width everywhere;
- ``"normalized"`` (a mean and a predictive std): ``|y - mean| / std``, intervals ``mean -+ t * std``,
  wider where the model is less certain (Papadopoulos et al. 2008; the std of any posthoc method);
- ``"cqr"`` (lower and upper quantiles, e.g. a model trained with a pinball loss): conformalised
  quantile regression (Romano et al. 2019), score ``max(lower - y, y - upper)``, intervals
  ``[lower - t, upper + t]`` (``t`` may be negative and narrow them).

Example:
    >>> import torch
    >>> from posthoc.guarantees.intervals import conformal_intervals
    >>> val_mean, val_std = torch.randn(500, 1), torch.full((500, 1), 0.5)       # a regressor's held-out predictions
    >>> val_y = val_mean + torch.randn(500, 1)                                   # whose stds are too narrow
    >>> test_mean, test_std = torch.randn(500, 1), torch.full((500, 1), 0.5)
    >>> test_y = test_mean + torch.randn(500, 1)
    >>> ci = conformal_intervals(val_y, mean=val_mean, std=val_std, alpha=0.1)
    >>> lower, upper = ci.intervals(mean=test_mean, std=test_std)
    >>> ((lower <= test_y) & (test_y <= upper)).float().mean()     # about 0.9
    tensor(0.9...)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from posthoc.core.checks import one_of, probability
from posthoc.core.inputs import like_given
from posthoc.errors import InputError
from posthoc.guarantees.bounds import conformal_threshold

#: the conformity scores, each named by what the predictions carry
SCORES = ("absolute", "normalized", "cqr")


def _columns(values: Tensor | None, what: str, count: int | None = None) -> Tensor | None:
    """``values`` as a float64 ``(N, D)`` tensor (a vector is one output), refusing non-finite values."""
    if values is None:
        return None
    values = torch.as_tensor(values).double()
    if values.dim() == 1:
        values = values[:, None]
    if values.dim() != 2:
        raise InputError(f"{what} must be (N,) or (N, D), got shape {tuple(values.shape)}")
    if count is not None and values.shape[0] != count:
        raise InputError(f"{what} has {values.shape[0]} rows but the targets have {count}; pass one per example")
    if not bool(torch.isfinite(values).all()):
        raise InputError(f"{what} holds NaN or infinite values")
    return values


def _score_for(mean: Tensor | None, std: Tensor | None, lower: Tensor | None, upper: Tensor | None) -> str:
    if (lower is None) != (upper is None):
        raise InputError("pass both lower and upper quantiles for conformalised quantile regression, or neither")
    if lower is not None:
        if mean is not None or std is not None:
            raise InputError("pass either lower/upper quantiles or a mean (with or without std), not both")
        return "cqr"
    if mean is None:
        raise InputError("pass the predictions: mean=..., mean and std=..., or lower= and upper= quantiles")
    return "absolute" if std is None else "normalized"


@dataclasses.dataclass(frozen=True)
class ConformalIntervals:
    """Calibrated interval widths, the score ``threshold`` ``t`` per output ``(D,)``; build with
    :func:`conformal_intervals`."""

    alpha: float
    score: str
    threshold: Tensor
    num_calibration: int

    def intervals(
        self,
        *,
        mean: Tensor | None = None,
        std: Tensor | None = None,
        lower: Tensor | None = None,
        upper: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(lower, upper)``, each ``(N, D)``, for test predictions of the kind calibrated on (numpy arrays for numpy
        predictions)."""
        given = (mean, std, lower, upper)
        mean, std, lower, upper = (
            _columns(v, name) for v, name in ((mean, "mean"), (std, "std"), (lower, "lower"), (upper, "upper"))
        )
        outputs = self.threshold.shape[0]
        for values, name in ((mean, "mean"), (std, "std"), (lower, "lower"), (upper, "upper")):
            if values is not None and values.shape[1] != outputs:
                raise InputError(
                    f"these intervals were calibrated on {outputs} output(s) but {name} has "
                    f"{values.shape[1]}; each output has its own threshold, so pass predictions of the "
                    "outputs calibrated on (or calibrate on this model's outputs)"
                )
        kind = _score_for(mean, std, lower, upper)
        if self.score == "absolute" and kind == "normalized":  # calibrated with score="absolute": std unused
            kind = "absolute"
        if kind != self.score:
            raise InputError(
                f"these intervals were calibrated with the {self.score!r} score but got the predictions "
                f"of the {kind!r} score; pass what calibration got"
            )
        width = self.threshold
        if self.score == "cqr":
            return like_given((lower - width, upper + width), *given)
        if self.score == "normalized":
            _positive(std)
            width = width * std
        return like_given((mean - width, mean + width), *given)


def _positive(std: Tensor) -> None:
    if not bool((std > 0).all()):
        raise InputError(
            "every predictive std must be > 0 for normalized intervals; use score='absolute' "
            "(pass no std) for a model without one"
        )


def conformal_intervals(
    y: Tensor,
    *,
    mean: Tensor | None = None,
    std: Tensor | None = None,
    lower: Tensor | None = None,
    upper: Tensor | None = None,
    alpha: float = 0.1,
    score: str | None = None,
) -> ConformalIntervals:
    """Calibrate intervals on held-out targets ``y`` ``(N,)`` or ``(N, D)`` and the model's predictions of them.

    The score is chosen by what is passed (see the module docs); ``score="absolute"`` with a ``std``
    ignores the std. Needs at least ``ceil(1 / alpha) - 1`` calibration examples.
    """
    alpha = probability(alpha, "alpha")
    y = _columns(y, "y")
    count = y.shape[0]
    mean, std, lower, upper = (
        _columns(v, name, count) for v, name in ((mean, "mean"), (std, "std"), (lower, "lower"), (upper, "upper"))
    )
    chosen = _score_for(mean, std, lower, upper)
    if score is not None:
        one_of(score, "score", SCORES)
        if score == "absolute" and chosen == "normalized":
            chosen, std = "absolute", None
        elif score != chosen:
            raise InputError(
                f"score={score!r} needs {'lower and upper quantiles' if score == 'cqr' else 'a mean'}"
                f"{' and a std' if score == 'normalized' else ''}; got the predictions of {chosen!r}"
            )
    for values, name in ((mean, "mean"), (std, "std"), (lower, "lower"), (upper, "upper")):
        if values is not None and values.shape[1] != y.shape[1]:
            raise InputError(f"{name} has {values.shape[1]} outputs but y has {y.shape[1]}")
    if chosen == "cqr":
        scores = torch.maximum(lower - y, y - upper)
    else:
        scores = (y - mean).abs()
        if chosen == "normalized":
            _positive(std)
            scores = scores / std
    threshold = torch.stack([conformal_threshold(scores[:, d], alpha) for d in range(scores.shape[1])])
    return ConformalIntervals(alpha=alpha, score=chosen, threshold=threshold, num_calibration=count)
