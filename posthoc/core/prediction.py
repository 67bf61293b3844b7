"""The :class:`Prediction` returned by every predictive, and the entropy decomposition.

Total predictive entropy splits into the expected entropy of the samples (aleatoric) and the
mutual information between prediction and parameters (epistemic):
``H[mean_s p_s] = mean_s H[p_s] + MI``.

Example:
    >>> import torch
    >>> from posthoc.core.prediction import Prediction
    >>> probs = torch.tensor([[0.9, 0.1], [0.5, 0.5]])
    >>> pred = Prediction.from_probs(probs)
    >>> pred.label.tolist()
    [0, 0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats, with ``0 log 0 = 0`` (safe at p = 0).

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import entropy
        >>> entropy(torch.tensor([1.0, 0.0])).item()
        0.0
    """
    return -torch.special.xlogy(probs, probs).sum(dim)


_PER_EXAMPLE = ("probs", "entropy", "aleatoric", "epistemic", "confidence", "label")


@dataclass(frozen=True)
class Prediction:
    """A predictive distribution over classes for a batch of ``N`` inputs.

    Attributes:
        probs: ``(N, C)`` predictive probabilities (the mean over samples when there are any).
        samples: ``(S, N, C)`` per-sample probabilities, or ``None`` for a deterministic predictive.
        entropy: ``(N,)`` total predictive entropy.
        aleatoric: ``(N,)`` expected entropy of the samples (equals ``entropy`` without samples).
        epistemic: ``(N,)`` mutual information, ``entropy - aleatoric`` (never below 0).
        confidence: ``(N,)`` largest class probability.
        label: ``(N,)`` the predicted class.
        sets: ``(N, C)`` boolean conformal prediction sets (``True`` = the class is in the set), or
            ``None``; filled by ``posthoc.conformal(...).predict(x)``.
    """

    probs: Tensor
    samples: Tensor | None
    entropy: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    confidence: Tensor
    label: Tensor
    sets: Tensor | None = None

    @classmethod
    def from_probs(cls, probs: Tensor, samples: Tensor | None = None) -> Prediction:
        """Build a prediction from probabilities ``(N, C)`` and optional samples ``(S, N, C)``.

        Example:
            >>> import torch
            >>> from posthoc.core.prediction import Prediction
            >>> samples = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
            >>> Prediction.from_probs(samples.mean(0), samples).epistemic
            tensor([0.6931])
        """
        total = entropy(probs)
        if samples is None:
            aleatoric = total
        else:
            aleatoric = entropy(samples).mean(0)
        epistemic = (total - aleatoric).clamp_min(0.0)
        confidence, label = probs.max(-1)
        return cls(probs, samples, total, aleatoric, epistemic, confidence, label)

    @classmethod
    def from_log_probs(cls, log_probs: Tensor, sample_log_probs: Tensor | None = None) -> Prediction:
        """Build a prediction from log-probabilities; samples, if given, are ``(S, N, C)``."""
        samples = None if sample_log_probs is None else sample_log_probs.exp()
        return cls.from_probs(log_probs.exp(), samples)

    @classmethod
    def empty_like(cls, part: Prediction, total: int, keep_samples: bool) -> Prediction:
        """Uninitialised outputs for ``total`` examples, shaped like chunk ``part``; fill with :meth:`write`."""

        def grow(tensor: Tensor, dim: int = 0) -> Tensor:
            shape = list(tensor.shape)
            shape[dim] = total
            return tensor.new_empty(shape)

        samples = grow(part.samples, 1) if keep_samples and part.samples is not None else None
        return cls(grow(part.probs), samples, *(grow(getattr(part, name)) for name in _PER_EXAMPLE[1:]))

    def write(self, start: int, part: Prediction) -> None:
        """Copy chunk ``part`` into examples ``start:start + len(part)`` of these outputs."""
        stop = start + len(part)
        for name in _PER_EXAMPLE:
            getattr(self, name)[start:stop] = getattr(part, name)
        if self.samples is not None:
            self.samples[:, start:stop] = part.samples

    def __len__(self) -> int:
        return self.probs.shape[0]

    @property
    def num_classes(self) -> int:
        return self.probs.shape[-1]
