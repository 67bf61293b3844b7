"""Fitting a calibration map's parameters by the (penalised) NLL of held-out labels, with L-BFGS.

Example:
    >>> scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    >>> minimise(lambda: mixture_nll(torch.log_softmax(logits * scale.exp(), -1), labels), [scale], max_iter=100)
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor

from posthoc.core.logits import log_mean_exp
from posthoc.core.threads import single_thread_if
from posthoc.engine.lbfgs import minimise

__all__ = ["SMALL_FIT", "minimise", "mixture_nll", "threads_for"]


def mixture_nll(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Mean NLL of ``labels`` under log-probabilities ``(N, C)``, or under the average of samples ``(S, N, C)``."""
    predictive = log_mean_exp(log_probs) if log_probs.dim() == 3 else log_probs
    return torch.nn.functional.nll_loss(predictive, labels)


#: below this many input elements a fit runs on one thread (see :func:`threads_for`)
SMALL_FIT = 1 << 20


def threads_for(inputs: Tensor) -> AbstractContextManager[None]:
    """Run a small fit (fewer than :data:`SMALL_FIT` input elements, on the CPU) on one thread.

    A calibration fit is thousands of tiny ops, where torch's intra-op threads only add synchronisation.
    """
    return single_thread_if(inputs.device.type == "cpu" and inputs.numel() < SMALL_FIT)
