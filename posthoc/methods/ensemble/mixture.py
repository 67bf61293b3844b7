"""The equal-weight mixture of member predictives, and what it keeps as samples.

Member ``m`` gives log-probabilities ``(N, C)`` and, when it samples, ``(S, N, C)`` per-sample
log-probabilities. The mixture's predictive is ``log mean_m p_m``; its samples are every member's
samples concatenated (a deterministic member counts as one sample, repeated to the others' ``S``),
so that the entropy split of the mixture gives the members' disagreement as epistemic uncertainty.

Example:
    >>> import torch
    >>> from posthoc.methods.ensemble.mixture import mixture
    >>> a, b = torch.log(torch.tensor([[0.9, 0.1]])), torch.log(torch.tensor([[0.1, 0.9]]))
    >>> log_probs, samples = mixture([(a, None), (b, None)])
    >>> log_probs.exp(), samples.shape
    (tensor([[0.5000, 0.5000]]), torch.Size([2, 1, 2]))
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core.logits import log_mean_exp
from posthoc.core.method import LogPredictive
from posthoc.errors import InputError


def check_same_classes(parts: list[LogPredictive]) -> None:
    """Refuse members whose predictives disagree on the batch or on the number of classes."""
    shapes = [tuple(log_probs.shape) for log_probs, _ in parts]
    if len(set(shapes)) > 1:
        listing = ", ".join(f"member {i}: {shape}" for i, shape in enumerate(shapes))
        raise InputError(
            f"ensemble members returned predictives of different shapes ({listing}); every member must "
            "classify the same inputs into the same classes"
        )


def mixture(parts: list[LogPredictive]) -> LogPredictive:
    """The equal-weight mixture of the members' ``(log_probs, samples)`` (see module docs)."""
    check_same_classes(parts)
    log_probs = log_mean_exp(torch.stack([member for member, _ in parts]))
    if all(samples is None for _, samples in parts):
        return log_probs, torch.stack([member for member, _ in parts])
    count = max(samples.shape[0] for _, samples in parts if samples is not None)
    samples = torch.cat([member.unsqueeze(0).expand(count, -1, -1) if own is None else own for member, own in parts])
    return log_probs, samples


def batched_mixture(member_log_probs: Tensor) -> LogPredictive:
    """The mixture of deterministic members given as one ``(M, N, C)`` tensor (the batched forward's output)."""
    return log_mean_exp(member_log_probs), member_log_probs
