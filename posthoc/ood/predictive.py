"""Scores of the predictive distribution: ``"msp"``, ``"entropy"``, ``"mutual-information"``, ``"gen"``; ``"variance"``.

They read ``Outputs.prediction``: a wrapped model's own predictive (``um.predict``) or a plain model's softmax.
``msp`` is Hendrycks & Gimpel (2017); ``gen`` is Liu et al. (CVPR 2023), summed as in the paper (pytorch-ood's
``GEN`` averages the same terms); ``mutual-information`` is 0 for deterministic predictives.

Example:
    >>> import torch
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.predictive import MaxSoftmax
    >>> from posthoc.core.prediction import Prediction
    >>> pred = Prediction.from_probs(torch.tensor([[0.9, 0.1], [0.5, 0.5]]))
    >>> MaxSoftmax()(Outputs(prediction=pred))
    tensor([-0.9000, -0.5000])
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from posthoc.core.checks import positive_int, positive_number
from posthoc.core.options import option
from posthoc.ood.base import Outputs, Score

PREDICTION = frozenset({"prediction"})


class MaxSoftmax(Score):
    """``-max_c p_c``: the negated confidence, so that larger = more OOD."""

    name, uses = "msp", PREDICTION

    def __call__(self, outputs: Outputs) -> Tensor:
        return -outputs.prediction.confidence


class PredictiveEntropy(Score):
    """The predictive's total entropy in nats."""

    name, uses = "entropy", PREDICTION

    def __call__(self, outputs: Outputs) -> Tensor:
        return outputs.prediction.entropy


class MutualInformation(Score):
    """The predictive's mutual information between prediction and parameters (epistemic part)."""

    name, uses = "mutual-information", PREDICTION

    def __call__(self, outputs: Outputs) -> Tensor:
        return outputs.prediction.epistemic


class PredictiveVariance(Score):
    """A regressor's total predictive variance, summed over the outputs (``um.predict(x).variance.sum(-1)``).

    Example:
        >>> import torch
        >>> from posthoc.ood.base import Outputs
        >>> from posthoc.ood.predictive import PredictiveVariance
        >>> from posthoc.core.prediction import RegressionPrediction
        >>> pred = RegressionPrediction.from_components(torch.zeros(1, 2, 1), None, torch.tensor([1.0, 4.0])[None, :, None])
        >>> PredictiveVariance()(Outputs(prediction=pred))
        tensor([1., 4.])
    """

    name, uses, tasks = "variance", PREDICTION, frozenset({"regression"})

    def __call__(self, outputs: Outputs) -> Tensor:
        return outputs.prediction.variance.sum(-1)


class GeneralizedEntropy(Score):
    """GEN: ``sum`` over the ``top`` largest probabilities (``None``: all) of ``p^gamma (1 - p)^gamma``."""

    name, uses = "gen", PREDICTION

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        gamma: float = option(0.1, "the exponent (the paper's 0.1)")
        top: int | None = option(100, "how many of the largest probabilities enter (the paper's M; None: all)")

    def __init__(self, *, gamma: float = 0.1, top: int | None = 100) -> None:
        super().__init__()
        self.gamma = positive_number(gamma, "gamma")
        self.top = positive_int(top, "top", none="all classes")

    def __call__(self, outputs: Outputs) -> Tensor:
        probs = outputs.prediction.probs
        if self.top is not None and self.top < probs.shape[-1]:
            probs = probs.topk(self.top, dim=-1).values
        return (probs.pow(self.gamma) * (1 - probs).pow(self.gamma)).sum(-1)
