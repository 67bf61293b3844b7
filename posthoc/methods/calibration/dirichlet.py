"""``"dirichlet"``: Dirichlet calibration (Kull et al., 2019): ODIR matrix scaling of the log-probabilities.

``softmax(W log p + b)`` with ``p = softmax(z)``: unlike matrix scaling of logits it sees only what the probabilities
say (logits shifted per row give the same result). The penalties are those of ``"matrix"``.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels, test_logits
    >>> posthoc.calibrate(logits, labels, method="dirichlet")(test_logits).shape
    torch.Size([128, 3])
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.methods.calibration.matrix import MatrixScaling


class DirichletCalibration(MatrixScaling):
    """``softmax(W log softmax(z) + b)`` with ODIR regularisation."""

    name = "dirichlet"

    @staticmethod
    def features(logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, -1)
