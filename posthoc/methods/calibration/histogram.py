"""``"histogram"``: histogram binning (Zadrozny & Elkan, 2001), per class (one-vs-rest) or top-label.

Each equal-width bin's probability is replaced by the held-out frequency of the event in that bin (``per-class``: "the
label is c" for ``p_c``, rows renormalised; ``top-label``: "the top class is right", the other classes rescaled to fill
the rest). ``smoothing`` pseudo-examples at the bin's mean probability keep a sparse bin from jumping to 0 or 1.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels, test_logits
    >>> posthoc.calibrate(logits, labels, method="histogram", bins=10, mode="top-label")(test_logits).shape
    torch.Size([128, 3])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from posthoc.core.checks import non_negative, one_of, positive_int
from posthoc.export.modules import cast
from posthoc.methods.calibration.base import Calibrator, predictive

MODES = ("per-class", "top-label")

#: the smallest probability a binned map gives a class (so that NLL stays finite)
FLOOR = 1e-6


def bin_index(probs: Tensor, bins: int) -> Tensor:
    """The equal-width bin ``[k/bins, (k+1)/bins)`` of each probability (1.0 in the last bin)."""
    return (probs * bins).long().clamp(0, bins - 1)


def binned_frequency(probs: Tensor, events: Tensor, bins: int, smoothing: float) -> Tensor:
    """Per bin: ``(events + smoothing * mean prob) / (count + smoothing)`` (an empty bin: its centre)."""
    index = bin_index(probs, bins)
    count = torch.bincount(index, minlength=bins).to(probs.dtype)
    hits = torch.bincount(index, weights=events.to(probs.dtype), minlength=bins)
    total = torch.bincount(index, weights=probs, minlength=bins)
    centre = (torch.arange(bins, dtype=probs.dtype, device=probs.device) + 0.5) / bins
    mean = torch.where(count > 0, total / count.clamp_min(1), centre)
    return torch.where(count + smoothing > 0, (hits + smoothing * mean) / (count + smoothing).clamp_min(1e-12), centre)


class HistogramBinning(Calibrator):
    """Equal-width bins whose probability is the held-out frequency of the event."""

    name = "histogram"
    extends = "temperature"
    per_sample = False
    interpolable = False
    min_per_class = 10

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        bins: int = 15
        mode: Literal[MODES] = "per-class"
        smoothing: float = 1.0

    def __init__(self, *, bins: int = 15, mode: str = "per-class", smoothing: float = 1.0) -> None:
        super().__init__()
        self.bins = positive_int(bins, "bins")
        self.mode = one_of(mode, "mode", MODES)
        self.smoothing = non_negative(smoothing, "smoothing")
        self.register_buffer("values", torch.empty(0))

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        probs = predictive(torch.log_softmax(inputs, -1)).exp()
        if self.mode == "top-label":
            confidence, predicted = probs.max(-1)
            self.values = binned_frequency(confidence, predicted == labels, self.bins, self.smoothing)[None].float()
            return
        events = torch.nn.functional.one_hot(labels, probs.shape[-1]).T
        self.values = torch.stack(
            [binned_frequency(p, e, self.bins, self.smoothing) for p, e in zip(probs.T, events)]
        ).float()

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        return histogram_log_probs, {"values": self.values.float()}, {"bins": self.bins, "mode": self.mode}


def histogram_log_probs(logits: Tensor, values: Tensor, bins: int, mode: str) -> Tensor:
    """The binned map of class logits ``(..., C)``: each probability (``"top-label"``: the top one, the rest scaled to
    fit) replaced by its bin's fitted frequency ``values`` ``(C or 1, bins)``, rows renormalised.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.histogram import histogram_log_probs
        >>> values = torch.tensor([[0.2, 0.8], [0.2, 0.8]])
        >>> histogram_log_probs(torch.tensor([[2.0, 0.0]]), values, 2, "per-class").exp()
        tensor([[0.8000, 0.2000]])
    """
    probs = torch.softmax(logits, -1)
    values = cast(values, probs.dtype)
    if mode == "top-label":
        confidence, predicted = probs.max(-1, keepdim=True)
        calibrated = values[0][bin_index(confidence, bins)].clamp(FLOOR, 1 - FLOOR)
        rest = (probs / (1 - confidence).clamp_min(FLOOR)) * (1 - calibrated)
        mapped = rest.scatter(-1, predicted, calibrated)
    else:
        index = bin_index(probs, bins)
        mapped = torch.gather(values.expand(*probs.shape[:-1], *values.shape), -1, index.unsqueeze(-1)).squeeze(-1)
    mapped = mapped.clamp_min(FLOOR)
    return (mapped / mapped.sum(-1, keepdim=True)).log()
