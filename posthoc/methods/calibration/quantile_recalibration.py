"""``"isotonic"`` for regression: isotonic recalibration of the predictive CDF (Kuleshov et al. 2018).

The probability integral transforms ``p_i = F(y_i)`` of a calibrated predictive are uniform. Per output, an isotonic
``R`` is fitted on the pairs ``(p_i, P̂(p_i))``, ``P̂`` the empirical CDF of the ``p_i``, and kept as its knots from
``(0, 0)`` to ``(1, 1)``. The recalibrated CDF is ``R(F(y))`` (:class:`~posthoc.core.recalibration.MonotoneMap`);
``mean`` and ``variance`` stay the uncalibrated moments.

Example:
    >>> import posthoc, torch
    >>> val_mean, test_mean, std = torch.randn(500), torch.randn(500), torch.full((500,), 2.0)   # stds twice too wide
    >>> val_y, test_y = val_mean + torch.randn(500), test_mean + torch.randn(500)
    >>> calibrator = posthoc.calibrate(mean=val_mean, std=std, targets=val_y, method="isotonic")
    >>> lower, upper = calibrator.predict(test_mean, std).interval(0.9)
    >>> ((lower[:, 0] <= test_y) & (test_y <= upper[:, 0])).float().mean()     # about 0.9
    tensor(0.9...)
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from torch import Tensor

from posthoc.core.prediction import RegressionPrediction
from posthoc.core.recalibration import MonotoneMap
from posthoc.methods.calibration.base import RegressionCalibrator


def fit_knots(pit: Tensor) -> tuple[Tensor, Tensor]:
    """Knots ``(D, M)`` of the isotonic maps of PIT values ``pit`` ``(N, D)``, from ``(0, 0)`` to ``(1, 1)``."""
    rows_x, rows_y = [], []
    for column in pit.double().cpu().numpy().T:
        ordered = np.sort(column)
        observed = np.searchsorted(ordered, ordered, side="right") / ordered.size  # the empirical CDF of the PITs
        fitted = IsotonicRegression(increasing=True, out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(ordered, observed)
        rows_x.append(np.concatenate([[0.0], fitted.X_thresholds_, [1.0]]))
        rows_y.append(np.concatenate([[0.0], fitted.y_thresholds_, [1.0]]))
    width = max(row.size for row in rows_x)
    pad = lambda row: np.concatenate([row, np.ones(width - row.size)])  # noqa: E731  (repeats of (1, 1))
    return (torch.as_tensor(np.stack([pad(r) for r in rows_x])), torch.as_tensor(np.stack([pad(r) for r in rows_y])))


class IsotonicRecalibration(RegressionCalibrator):
    """Recalibrate the predictive CDF by an isotonic map of held-out PIT values."""

    name = "isotonic"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("knots_x", torch.zeros(0, 2, dtype=torch.float64))
        self.register_buffer("knots_y", torch.zeros(0, 2, dtype=torch.float64))

    @property
    def mapping(self) -> MonotoneMap:
        """The fitted map ``R`` per output."""
        return MonotoneMap(self.knots_x, self.knots_y)

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        self.knots_x, self.knots_y = (knots.to(targets.device) for knots in fit_knots(prediction.cdf(targets)))

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        return prediction.recalibrate(self.mapping)
