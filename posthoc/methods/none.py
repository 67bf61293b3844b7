"""``"none"``: the model's own softmax, the plain (MAP) model: the reference row of every table.

Example:
    >>> um = posthoc.wrap(model, method="none")
    >>> um.predict(x).samples is None
    True
"""

from __future__ import annotations

import torch

from posthoc.core.registry import register
from posthoc.core.method import LogPredictive, Method
from posthoc.core.inputs import Inputs, run_model
from posthoc.core.logits import class_log_probs


@register
class PlainModel(Method):
    """The trained model as it is: ``softmax(model(x))``. Needs no fit."""

    name = "none"
    requires_fit = False

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None,
                       max_memory: int | None = None) -> LogPredictive:
        return class_log_probs(run_model(self.model, x)), None
