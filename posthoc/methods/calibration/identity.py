"""``"identity"``: the model's own probabilities, ``softmax(z)``: the reference ``"auto"`` must beat.

Example:
    >>> import posthoc, torch
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> torch.allclose(posthoc.calibrate(logits, labels, method="identity")(logits), torch.softmax(logits, -1))
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posthoc.export.modules import LogSoftmax
from posthoc.methods.calibration.base import Calibrator, held_out_logits


class Identity(Calibrator):
    """No calibration: ``softmax(z)``. Parameters: 0."""

    name = "identity"
    min_examples = 0

    def fit(self, logits: Any, labels: Any) -> Identity:
        """Nothing to fit: only the number of classes is recorded (of logits read as every calibrator reads them)."""
        logits, _ = held_out_logits(logits, labels)
        self.num_classes.fill_(logits.shape[-1])
        return self

    def _transform(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, -1)

    def log_prob_map(self) -> nn.Module:
        return LogSoftmax()
