"""Turning a classifier's raw output into class log-probabilities.

Multi-class logits ``(N, C)`` pass through ``log_softmax``; a binary classifier's single logit ``(N,)`` or ``(N, 1)``
becomes the two-class logits ``[0, z]`` (so ``p(1) = sigmoid(z)``). :func:`logits_of` duck-types a Hugging Face
``ModelOutput`` so that the core never imports ``transformers``.

Example:
    >>> import torch
    >>> from posthoc.core.logits import as_class_logits, log_mean_exp
    >>> as_class_logits(torch.tensor([0.0, 2.0])).shape
    torch.Size([2, 2])
    >>> log_mean_exp(torch.log(torch.tensor([[0.2, 0.8], [0.4, 0.6]]))).exp()
    tensor([0.3000, 0.7000])
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from posthoc.errors import InputError

LOGITS_KEY = "logits"
#: log-probabilities below this are clamped before a calibration map sees them (an exact 0 probability is -inf)
LOG_PROB_FLOOR = -1e4
#: how far from 1 a row of probabilities may sum (float32 softmax outputs, rounding when saved)
ROW_SUM_TOLERANCE = 1e-3


def logits_of(output: Any) -> Tensor:
    """The logits tensor of a model's ``output``: the tensor itself, or its ``logits`` attribute / key (refusing per
    position outputs ``(N, T, C)``).

    Example:
        >>> import torch
        >>> from posthoc.core.logits import logits_of
        >>> logits_of({"logits": torch.zeros(2, 3)}).shape
        torch.Size([2, 3])
    """
    logits = output
    if not isinstance(output, Tensor):
        logits = getattr(output, LOGITS_KEY, None)
        if logits is None and isinstance(output, Mapping):
            logits = output.get(LOGITS_KEY)
    if not isinstance(logits, Tensor):
        fields = f" (its fields: {', '.join(map(str, output.keys()))})" if isinstance(output, Mapping) else ""
        raise InputError(
            f"the model returned {type(output).__name__}{fields}, with no tensor of logits; pass a classifier whose "
            "forward returns logits (N, C) or an output with a .logits field (e.g. a Hugging Face "
            "AutoModelForSequenceClassification / AutoModelForImageClassification rather than a bare AutoModel)"
        )
    if logits.dim() > 2:
        raise InputError(
            f"the model returned per-position logits of shape {tuple(logits.shape)} (one prediction per token or "
            "pixel) without dense=True. For a segmentation map or a token sequence, with labels per position, "
            "wrap it with posthoc.wrap(model, method=..., dense=True); for one label per input, pass a "
            "sequence/image classifier (e.g. AutoModelForSequenceClassification) whose logits are (N, C)"
        )
    return logits


def as_class_logits(logits: Tensor) -> Tensor:
    """Return logits of shape ``(N, C)`` with ``C >= 2`` (see module docs)."""
    if not isinstance(logits, Tensor):
        raise InputError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() == 1 or (logits.dim() == 2 and logits.shape[1] == 1):
        z = logits.reshape(-1, 1)
        return torch.cat([torch.zeros_like(z), z], dim=1)
    if logits.dim() != 2:
        raise InputError(
            f"expected logits of shape (N, C) (or (N,) for a binary classifier), got {tuple(logits.shape)}; "
            "flatten extra dimensions or wrap the model so it returns per-example logits"
        )
    return logits


def class_log_probs(logits: Tensor) -> Tensor:
    """``log_softmax`` of :func:`as_class_logits`, computed in at least float32."""
    logits = as_class_logits(logits)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1)


def check_finite_logits(logits: Tensor) -> None:
    """Refuse NaN/inf logits with a message saying where they usually come from."""
    if not torch.isfinite(logits).all():
        bad = int((~torch.isfinite(logits)).any(-1).sum()) if logits.dim() > 1 else int((~torch.isfinite(logits)).sum())
        raise InputError(
            f"{bad} example(s) have NaN or inf logits; check the model's inputs and weights "
            "(float16 overflow is a common cause) before calibrating"
        )


def log_mean_exp(samples: Tensor, dim: int = 0) -> Tensor:
    """``log(mean(exp(samples), dim))``, stable: the predictive of per-sample log-probabilities (in place, faster than
    ``torch.logsumexp`` on CPU); a slice that is ``-inf`` throughout stays ``-inf``."""
    top = samples.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return (samples - top).exp_().mean(dim=dim).log_().add_(top.squeeze(dim))


def looks_like_probabilities(values: Tensor) -> bool:
    """Whether every entry is in ``[0, 1]`` and every row sums to 1 (within :data:`ROW_SUM_TOLERANCE`)."""
    return bool(
        values.numel()
        and values.min() >= 0
        and values.max() <= 1
        and ((values.double().sum(-1) - 1).abs() <= ROW_SUM_TOLERANCE).all()
    )


def check_not_probabilities(logits: Tensor) -> None:
    """Refuse probabilities passed where logits are expected; warn for binary scores in [0, 1].

    Example:
        >>> import torch
        >>> from posthoc.core.logits import check_not_probabilities
        >>> check_not_probabilities(torch.tensor([[0.7, 0.3], [0.1, 0.9]]))
        Traceback (most recent call last):
        posthoc.errors.InputError: these logits look like probabilities...
    """
    if logits.numel() == 0 or logits.min() < 0 or logits.max() > 1:
        return
    if logits.dim() == 2 and logits.shape[1] > 1:
        if looks_like_probabilities(logits):
            raise InputError(
                "these logits look like probabilities: every row lies in [0, 1] and sums to 1. Calibrators "
                "take the model's logits (its output before the softmax); pass those, or torch.log(probs)"
            )
        return
    warnings.warn(
        "every binary logit lies in [0, 1]: if these are probabilities of class 1, pass their logits "
        "instead, torch.logit(p)",
        RuntimeWarning,
        stacklevel=3,
    )
