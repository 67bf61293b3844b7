"""What the verdict reads of reports of several methods on one test set, and what a caller measures for it.

:func:`candidate` turns a method's :class:`~posthoc.evaluation.report.Report` into a
:class:`~posthoc.evaluation.verdict.Candidate`; :func:`compared_verdict` judges reports against the first (the plain
model); :func:`predict_timing` times a wrapped model's predict against a plain forward.

Example:
    >>> from posthoc.evaluation.comparison import compared_verdict
    >>> from posthoc_apps.demo.examples import plain_report, report, plain_noisy_report, noisy_report
    >>> found = compared_verdict([plain_report, report], {"noisy": [plain_noisy_report, noisy_report]})
    >>> print(found.lines()[1])
    It lowers the NLL in distribution by 0.1068 nats (0.82x the plain model's 0.5966).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.inputs import Inputs, run_model, to_device
from posthoc.core.modules import eval_mode
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError
from posthoc.evaluation import verdict


def example_nll(report: Any) -> Tensor:
    """The per-example NLL ``(N,)`` of a report's kept predictions (the mean is ``report.nll``), float64 on the CPU.

    Example:
        >>> from posthoc.evaluation.comparison import example_nll
        >>> from posthoc_apps.demo.examples import report
        >>> example_nll(report).shape
        torch.Size([128])
    """
    return report.example_nll()


def candidate(
    report: Any,
    shifts: Mapping[str, Any] | None = None,
    *,
    predict_cost: float | None = None,
    selection: Mapping[str, Any] | None = None,
    shifted: Mapping[str, Tensor] | None = None,
    forward_seconds: float | None = None,
) -> verdict.Candidate:
    """What the verdict reads of one method's report. ``shifts``: name -> its report on that shifted test set;
    ``shifted``: name -> per-example NLL already computed (:meth:`posthoc.evaluation.shift.ShiftTable.example_nll`);
    the others default to the report's own.

    Example:
        >>> from posthoc.evaluation.comparison import candidate
        >>> from posthoc_apps.demo.examples import report, noisy_report
        >>> candidate(report, {"noisy": noisy_report}).shifted["noisy"].shape
        torch.Size([128])
    """
    own = getattr(report, "ood_values", None) or {}
    return verdict.Candidate(
        report.name,
        example_nll(report),
        {**{name: example_nll(found) for name, found in (shifts or {}).items()}, **(shifted or {})},
        own.get("entropy"),
        getattr(report, "predict_cost", None) if predict_cost is None else predict_cost,
        getattr(report, "selection", None) if selection is None else selection,
        getattr(report, "forward_seconds", None) if forward_seconds is None else forward_seconds,
    )


def compared_verdict(
    reports: Sequence[Any], shifts: Mapping[str, Sequence[Any]] | None = None, **options: Any
) -> verdict.Verdict:
    """The verdict on ``reports`` of several methods on the same test set, the first being the plain model;
    ``shifts``: name -> reports on that shifted set, in the same order; ``options`` go to
    :func:`posthoc.evaluation.verdict.judge`."""
    for name, found in (shifts or {}).items():
        if len(found) != len(reports):
            raise ConfigError(
                f"shift {name!r} has {len(found)} reports for {len(reports)} methods: give one per "
                "report, in the same order"
            )
    rows = [
        candidate(report, {name: found[i] for name, found in (shifts or {}).items()})
        for i, report in enumerate(reports)
    ]
    return verdict.judge(rows, reports[0].name, **options)


@dataclass(frozen=True)
class PredictTiming:
    """A wrapped model's predict time against a plain forward on the same inputs: median ``seconds`` of each, and
    their ``ratio`` (the verdict's predict cost)."""

    seconds: float
    forward_seconds: float

    @property
    def ratio(self) -> float:
        return self.seconds / max(self.forward_seconds, 1e-9)


def predict_timing(um: UncertainModel, x: Inputs, *, repeats: int = 3) -> PredictTiming:
    """The median time of ``um.predict(x)`` and of a plain forward of the user's model (for an ensemble, its first
    member) on the same inputs, each timed ``repeats`` times after one warm-up call.

    Example:
        >>> import posthoc
        >>> from posthoc.evaluation.comparison import predict_timing
        >>> from posthoc_apps.demo.examples import model, x
        >>> timing = predict_timing(posthoc.wrap(model, method="none"), x)
        >>> timing.forward_seconds > 0 and timing.ratio > 0       # about 1: the plain forward itself
        True
    """
    x = to_device(x, um.device)
    generator = torch.Generator(device=um.device).manual_seed(0)

    def median_seconds(call: Any) -> float:
        call()
        times = []
        for _ in range(repeats):
            _synchronize(um.device)
            start = time.perf_counter()
            call()
            _synchronize(um.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    model = um.method.plain_model
    with torch.no_grad(), eval_mode(model):
        plain = median_seconds(lambda: run_model(model, x))
    return PredictTiming(median_seconds(lambda: um.predict(x, generator=generator)), plain)


def predict_cost(um: UncertainModel, x: Inputs, *, repeats: int = 3) -> float:
    """The median time of ``um.predict(x)`` over that of a plain forward (:func:`predict_timing`'s ratio)."""
    return predict_timing(um, x, repeats=repeats).ratio


def auto_selection(um: UncertainModel) -> dict[str, Any] | None:
    """``method="auto"``'s selection record between whole methods (``um.summary()["selection"]``), else ``None``.

    Example:
        >>> import posthoc
        >>> from posthoc.evaluation.comparison import auto_selection
        >>> from posthoc_apps.demo.examples import model, train_loader, val_loader
        >>> auto_selection(posthoc.wrap(model, method="auto").fit(train_loader, val_loader))["chosen"]
        'laplace+dac'
    """
    if "auto" not in um.methods:
        return None
    found = um.summary().get("selection")
    return found if found and found.get("knob") == verdict.METHOD_KNOB else None


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a timing covers what it ran (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
