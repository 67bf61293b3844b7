"""Fitting a calibration map's parameters by the (penalised) NLL of held-out labels, with L-BFGS.

Example:
    >>> import torch
    >>> from posthoc.engine.lbfgs import minimise
    >>> from posthoc.methods.calibration.optimise import mixture_nll
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    >>> minimise(lambda: mixture_nll(torch.log_softmax(logits * scale.exp(), -1), labels), [scale], max_iter=100)
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core.logits import log_mean_exp
from posthoc.engine.lbfgs import minimise

__all__ = ["minimise", "mixture_nll"]


def mixture_nll(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Mean NLL of ``labels`` under log-probabilities ``(N, C)``, or under the average of samples ``(S, N, C)``."""
    predictive = log_mean_exp(log_probs) if log_probs.dim() == 3 else log_probs
    return torch.nn.functional.nll_loss(predictive, labels)
