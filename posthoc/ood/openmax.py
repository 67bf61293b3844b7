"""``"openmax"``: the probability of an unknown class from extreme-value statistics of the logits (Bendale &
Boult, CVPR 2016).

Fit keeps the training logits and labels (``C + 1`` numbers an example). For each class ``c``, ``mu_c`` is the mean
logit vector of the correctly classified training examples of ``c``, and a Weibull distribution is fitted to the
``tailsize`` largest distances ``d(l, mu_c)`` of them (``d``: ``euclidean_weight`` times the Euclidean plus
``1 - euclidean_weight`` times the cosine distance), after the shift ``d - min(tail) + 10000`` the paper's libMR
applies; the fit is scipy's maximum likelihood with the location fixed at 0 (``weibull_min``, which solves the
likelihood equations; pytorch-ood's ``exponweib`` fit by simplex search lands within ~1e-6 of it).

At scoring, the ``alpha = revised`` largest logits ``l_c`` (rank ``r = 1..alpha``) are discounted by
``w_c = ((alpha + 1 - r) / alpha) F_c(d(l, mu_c))``, ``F_c`` the Weibull CDF: ``l_c (1 - w_c)`` stay and
``sum_c l_c w_c`` becomes the logit of an unknown class; the score is that class's softmax probability, as
pytorch-ood's ``OpenMax`` (which fits on every training example of a class, not only the correct ones).

Example:
    >>> import torch
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.openmax import OpenMax
    >>> logits, labels = torch.randn(300, 3) + 4 * torch.eye(3)[torch.arange(300) % 3], torch.arange(300) % 3
    >>> score = OpenMax(tailsize=20, revised=2)
    >>> score.update(Outputs(logits=logits), labels, 0); score.finish(0)
    >>> score(Outputs(logits=logits)).shape
    torch.Size([300])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import weibull_min
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.checks import positive_int, unit_interval
from posthoc.core.options import option
from posthoc.errors import InputError
from posthoc.ood.base import Outputs, Score

#: libMR's shift of the tail distances before the Weibull fit
TRANSLATION = 10000.0


class OpenMax(Score):
    """The OpenMax probability of the unknown class."""

    name, uses, fit_passes, needs_labels = "openmax", frozenset({"logits"}), 1, True

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        tailsize: int = option(20, "how many of each class's largest distances the Weibull fit reads (libMR's 20)")
        revised: int = option(10, "how many of the largest logits are revised (the paper's alpha; at most the classes)")
        euclidean_weight: float = option(1.0, "the Euclidean distance's weight; the cosine distance gets the rest")

    def __init__(self, *, tailsize: int = 20, revised: int = 10, euclidean_weight: float = 1.0) -> None:
        self.tailsize = positive_int(tailsize, "tailsize")
        self.revised = positive_int(revised, "revised")
        self.euclidean_weight = unit_interval(euclidean_weight, "euclidean_weight")
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._logits: list[Tensor] = []
        self._labels: list[Tensor] = []

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        self._logits.append(outputs.logits.detach().double())
        self._labels.append(labels)

    def _distance(self, logits: Tensor, centres: Tensor) -> Tensor:
        """``d`` of each row of ``logits (..., C)`` to the matching row of ``centres (..., C)``."""
        distance = self.euclidean_weight * (logits - centres).norm(dim=-1)
        if self.euclidean_weight < 1:
            cosine = (logits * centres).sum(-1) / (logits.norm(dim=-1) * centres.norm(dim=-1))
            distance = distance + (1 - self.euclidean_weight) * (1 - cosine)
        return distance

    def finish(self, pass_index: int) -> None:
        logits = distributed.gather_cat(torch.cat(self._logits))
        labels = distributed.gather_cat(torch.cat(self._labels))
        self._logits, self._labels = [], []
        correct = logits.argmax(-1) == labels
        classes = logits.shape[-1]
        counts = torch.bincount(labels[correct], minlength=classes)
        short = (counts < self.tailsize).nonzero().flatten().tolist()
        if short:
            raise InputError(
                f"OpenMax fits a Weibull tail of tailsize={self.tailsize} distances per class to the correctly "
                f"classified training examples, but class(es) {short[:10]} have only "
                f"{counts[short[:10]].tolist()}; pass tailsize= at most {int(counts.min())} or fit on more data"
            )
        self.centres = torch.stack([logits[correct & (labels == c)].mean(0) for c in range(classes)])
        shapes, scales, minima = [], [], []
        for c in range(classes):
            members = logits[correct & (labels == c)]
            tail = self._distance(members, self.centres[c]).sort().values[-self.tailsize :]
            shape, _, scale = weibull_min.fit((tail - tail[0] + TRANSLATION).numpy(force=True), floc=0)
            shapes.append(shape)
            scales.append(scale)
            minima.append(tail[0])
        self.weibull_shape, self.weibull_scale = logits.new_tensor(shapes), logits.new_tensor(scales)
        self.tail_minimum = torch.stack(minima)
        self.fitted = True

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        logits = outputs.logits.double()
        alpha = min(self.revised, logits.shape[-1])
        top = logits.topk(alpha, dim=-1).indices  # (N, alpha), largest first
        distance = self._distance(logits[:, None, :], self.centres.to(logits.device)[top])
        shifted = (distance - self.tail_minimum.to(logits.device)[top] + TRANSLATION).clamp_min(0)
        ratio = shifted / self.weibull_scale.to(logits.device)[top]
        cdf = -torch.expm1(-ratio.pow(self.weibull_shape.to(logits.device)[top]))
        rank_weight = (alpha - torch.arange(alpha, device=logits.device, dtype=logits.dtype)) / alpha
        discount = torch.zeros_like(logits).scatter(-1, top, rank_weight * cdf)
        revised = torch.cat([(logits * discount).sum(-1, keepdim=True), logits * (1 - discount)], dim=-1)
        return revised.softmax(-1)[:, 0].to(outputs.logits.dtype)
