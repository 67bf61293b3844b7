"""``"variance-scaling"``: one factor ``s`` per output multiplying the predictive std (Levi et al. 2019).

``s`` minimises the held-out Gaussian NLL: for one Gaussian per example ``s² = mean((y - μ)² / σ²)``. A mixture
(ensembles, sampled networks) is scaled about its mean, ``μ + s (Y - μ)``
(:meth:`~posthoc.core.prediction.RegressionPrediction.scaled`), which keeps it an exact mixture whose std is times
``s``; ``s`` then minimises each output's marginal mixture NLL by golden-section search in ``log s``.

Example:
    >>> import posthoc, torch
    >>> mean, std = torch.randn(500), torch.full((500,), 2.0)    # stds twice too wide
    >>> calibrator = posthoc.calibrate(mean=mean, std=std, targets=mean + torch.randn(500), method="variance-scaling")
    >>> round(float(calibrator.scale[0]), 1)      # 0.5: the stds were twice too wide
    0.5
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.core.likelihood import golden_minimum
from posthoc.core.prediction import RegressionPrediction
from posthoc.methods.calibration.base import RegressionCalibrator

#: the search interval of a mixture's ``log s``: this factor either side of the closed form on its total std
SEARCH_FACTOR = 100.0


def closed_form_scale(prediction: RegressionPrediction, targets: Tensor) -> Tensor:
    """``(D,)``: ``sqrt(mean((y - μ)² / σ²))`` per output, the NLL-optimal scale of a single Gaussian."""
    return ((targets - prediction.mean).square() / prediction.variance).mean(0).sqrt()


def numerical_scale(prediction: RegressionPrediction, targets: Tensor) -> Tensor:
    """``(D,)``: the scale minimising each output's exact marginal NLL of ``prediction.scaled(s)``.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.variance_scaling import closed_form_scale, numerical_scale
        >>> from posthoc.methods.calibration.base import as_prediction
        >>> mean = torch.randn(500)
        >>> pred, y = as_prediction(mean, torch.full((500,), 2.0)), (mean + torch.randn(500)).double()[:, None]
        >>> torch.allclose(numerical_scale(pred, y), closed_form_scale(pred, y), atol=1e-3)   # for one Gaussian
        True
    """
    start = closed_form_scale(prediction, targets)
    scales = []
    for d in range(prediction.num_outputs):

        def nll(log_scale: float, d: int = d) -> float:
            scale = torch.ones(prediction.num_outputs, dtype=targets.dtype)
            scale[d] = math.exp(log_scale)
            return -float(prediction.scaled(scale).distribution.marginal_log_prob(targets)[:, d].mean())

        centre = math.log(max(float(start[d]), 1e-300))
        scales.append(math.exp(golden_minimum(nll, centre - math.log(SEARCH_FACTOR), centre + math.log(SEARCH_FACTOR))))
    return torch.tensor(scales, dtype=targets.dtype)


class VarianceScaling(RegressionCalibrator):
    """Multiply every output's predictive std by a factor fitted on held-out NLL."""

    name = "variance-scaling"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(0, dtype=torch.float64))

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        single = prediction.component_means.shape[0] == 1
        scale = closed_form_scale(prediction, targets) if single else numerical_scale(prediction, targets)
        self.scale = scale.clamp_min(torch.finfo(torch.float64).tiny)

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        return prediction.scaled(self.scale)
