"""``posthoc.compare``: the paired difference of a metric between two reports on the same test examples.

Both reports are resampled with the same bootstrap indices, so the interval of the difference accounts for the
examples being shared: when it excludes 0, "A beats B on this test set" is backed at that level.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import um, test_loader, model
    >>> laplace = posthoc.evaluate(um, test_loader)
    >>> plain = posthoc.evaluate(posthoc.wrap(model, method="none"), test_loader)
    >>> print(posthoc.compare(laplace, plain, metric="nll"))
    nll: laplace − none = -0.1068 [-0.2387, -0.0011] (95% paired bootstrap, 1000 resamples of 128 examples)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap
from posthoc.evaluation.report import Report

#: metrics that can be compared pair-wise (those computed from the reports' probabilities and labels)
COMPARABLE = ("accuracy", "nll", "ece", "adaptive_ece", "smooth_ece", "brier", "aurc", "augrc")


@dataclass(frozen=True)
class Comparison:
    """``first`` minus ``second`` on ``metric``: their values, the difference and its bootstrap interval."""

    metric: str
    first: str
    second: str
    first_value: float
    second_value: float
    difference: float
    interval: tuple[float, float]
    ci: float
    bootstraps: int
    examples: int

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval of the difference lies entirely on one side of 0."""
        return self.interval[0] > 0 or self.interval[1] < 0

    def as_dict(self) -> dict[str, object]:
        return {
            "metric": self.metric,
            "first": self.first,
            "second": self.second,
            "first_value": self.first_value,
            "second_value": self.second_value,
            "difference": self.difference,
            "interval": list(self.interval),
            "ci": self.ci,
            "bootstraps": self.bootstraps,
            "examples": self.examples,
        }

    def __str__(self) -> str:
        low, high = self.interval
        return (
            f"{self.metric}: {self.first} − {self.second} = {self.difference:.4f} [{low:.4f}, {high:.4f}] "
            f"({self.ci:.0%} paired bootstrap, {self.bootstraps} resamples of {self.examples} examples)"
        )


def compare(
    first: Report,
    second: Report,
    metric: str = "nll",
    *,
    ci: float = 0.95,
    bootstraps: int = 1000,
    seed: int = 0,
    method: str = "percentile",
) -> Comparison:
    """The difference ``first - second`` of ``metric`` with a paired bootstrap interval over the shared test examples.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import report, plain_report
        >>> posthoc.compare(report, plain_report, metric="nll").excludes_zero    # laplace's NLL is lower
        True
        >>> posthoc.compare(report, plain_report, metric="ece").excludes_zero    # its ECE: not shown on 128 examples
        False
    """
    if metric not in COMPARABLE:
        raise ConfigError(f"cannot compare {metric!r}; comparable metrics: {', '.join(COMPARABLE)}")
    for report in (first, second):
        if not isinstance(report, Report):
            raise InputError(
                f"compare takes two posthoc.Report objects (from posthoc.evaluate), got {type(report).__name__}"
            )
        if report.kind != "categorical":
            raise InputError(
                f"compare reads a classifier's probabilities; report {report.name!r} is a {report.kind} report: "
                "compare its rows with report.to_markdown(other) (the verdict's paired intervals)"
            )
        if report.probs is None or report.labels is None:
            raise InputError(f"report {report.name!r} keeps no probabilities; compare reports made by posthoc.evaluate")
    if first.labels.shape != second.labels.shape or not torch.equal(first.labels.cpu(), second.labels.cpu()):
        raise InputError(
            f"reports {first.name!r} and {second.name!r} are not on the same test examples (their labels "
            "differ); evaluate both on the same loader, without shuffling"
        )
    one = bootstrap.example_statistics(first.probs, first.labels)[metric]
    two = bootstrap.example_statistics(second.probs, second.labels)[metric]
    n = len(first.labels)
    paired = bootstrap.difference(one, two)
    interval = bootstrap.intervals({metric: paired}, n, ci=ci, bootstraps=bootstraps, seed=seed, method=method)[metric]
    identity = torch.arange(n)[None]
    a, b = float(one(identity)[0]), float(two(identity)[0])
    return Comparison(metric, first.name, second.name, a, b, a - b, interval, ci, bootstraps, n)
