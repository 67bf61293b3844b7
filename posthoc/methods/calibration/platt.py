"""``"platt"``: Platt scaling for binary classifiers: ``p(1) = sigmoid(a z + b)`` (Platt, 1999).

``z`` is the classifier's one logit (``(N,)`` or ``(N, 1)``), or ``z_1 - z_0`` for two-class logits.

Example:
    >>> import posthoc, torch
    >>> scores = 3 * torch.randn(200)                       # a binary classifier's logits (N,) ...
    >>> binary = (torch.rand(200) < torch.sigmoid(scores / 3)).long()   # ... three times too confident
    >>> calibrator = posthoc.calibrate(scores, binary, method="platt")
    >>> calibrator(scores)[:, 1].shape        # calibrated p(class 1)
    torch.Size([200])
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.methods.calibration.affine import AffineCalibrator


class PlattScaling(AffineCalibrator):
    """``sigmoid(a z + b)`` for a binary classifier's logit ``z``."""

    name = "platt"
    extends = "temperature"
    binary_only = True

    def initial(self, num_classes: int, like: Tensor) -> tuple[Tensor, Tensor]:
        options = {"dtype": like.dtype, "device": like.device}
        return torch.ones(1, **options), torch.zeros(1, **options)

    @staticmethod
    def apply(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        margin = features[..., 1:] - features[..., :1]
        return torch.cat([torch.zeros_like(margin), margin * weight + bias], -1)
