"""``"isotonic"``: isotonic regression, one-vs-rest per class, rows renormalised (Zadrozny & Elkan, 2002).

For each class ``c`` scikit-learn's ``IsotonicRegression`` fits a non-decreasing map from ``p_c`` to the held-out
frequency of "the label is c"; its step points are kept as padded tensors and interpolated linearly, as its
``predict`` does.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels, test_logits
    >>> posthoc.calibrate(logits, labels, method="isotonic")(test_logits).shape
    torch.Size([128, 3])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sklearn.isotonic import IsotonicRegression as SklearnIsotonic
from torch import Tensor

from posthoc.export.modules import cast
from posthoc.methods.calibration.base import Calibrator, predictive
from posthoc.methods.calibration.histogram import FLOOR


def interpolate(x: Tensor, points: Tensor, values: Tensor, size: int) -> Tensor:
    """Piecewise-linear interpolation of ``x`` through ``size`` sorted ``points``, clipped at the ends."""
    points, values = points[:size], values[:size]
    if size == 1:
        return values.expand_as(x).clone()
    right = (x.unsqueeze(-1) > points).sum(-1).clamp(1, size - 1)  # searchsorted, in ops every exporter takes
    x0, x1, y0, y1 = points[right - 1], points[right], values[right - 1], values[right]
    slope = torch.where(x1 > x0, (y1 - y0) / (x1 - x0).clamp_min(1e-300), torch.zeros_like(x1))
    return (y0 + slope * (x.clamp(points[0], points[-1]) - x0)).clamp(values[0], values[-1])


def isotonic_log_probs(logits: Tensor, points: Tensor, values: Tensor, sizes: list[int]) -> Tensor:
    """One-vs-rest isotonic maps of the class probabilities (in float64), rows renormalised: class ``c`` maps through
    the first ``sizes[c]`` of its ``points`` and ``values`` ``(C, L)``.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.isotonic import isotonic_log_probs
        >>> points, values = torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
        >>> isotonic_log_probs(torch.tensor([[1.0, 0.0]]), points, values, [2, 2]).exp()
        tensor([[0.7311, 0.2689]])
    """
    probs = torch.softmax(logits.double(), -1)
    points, values = cast(points, torch.float64), cast(values, torch.float64)
    mapped = torch.stack(
        [interpolate(probs[..., c], points[c], values[c], size) for c, size in enumerate(sizes)], -1
    ).clamp_min(FLOOR)
    return cast((mapped / mapped.sum(-1, keepdim=True)).log(), logits.dtype)


class IsotonicCalibration(Calibrator):
    """One-vs-rest isotonic maps of the class probabilities, renormalised."""

    name = "isotonic"
    extends = "temperature"
    per_sample = False
    interpolable = False
    min_per_class = 10

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("points", torch.empty(0))
        self.register_buffer("values", torch.empty(0))
        self.register_buffer("sizes", torch.empty(0, dtype=torch.long))

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        probs = predictive(torch.log_softmax(inputs, -1)).exp().cpu().numpy()
        events = torch.nn.functional.one_hot(labels, probs.shape[-1]).cpu().numpy()
        fitted = [
            SklearnIsotonic(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(probs[:, c], events[:, c])
            for c in range(probs.shape[-1])
        ]
        longest = max(len(f.X_thresholds_) for f in fitted)
        points = torch.zeros(len(fitted), longest, dtype=torch.float64)
        values = torch.zeros(len(fitted), longest, dtype=torch.float64)
        for c, f in enumerate(fitted):
            points[c, : len(f.X_thresholds_)] = torch.as_tensor(f.X_thresholds_)
            values[c, : len(f.y_thresholds_)] = torch.as_tensor(f.y_thresholds_)
        self.points, self.values = points.to(inputs.device), values.to(inputs.device)
        self.sizes = torch.tensor([len(f.X_thresholds_) for f in fitted], device=inputs.device)

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        return isotonic_log_probs, {"points": self.points, "values": self.values}, {"sizes": self.sizes.tolist()}

    def num_parameters(self) -> int:
        return 2 * int(self.sizes.sum())
