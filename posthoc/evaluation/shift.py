"""``posthoc.evaluate_shift``: one or several wrapped models on a test set corrupted by kind and severity.

Each method is evaluated on the clean test set (severity 0) and on ``posthoc.shift.corrupt(test_loader,
kind, severity)`` for every kind and severity (the same seeded corruption for every method). The
:class:`ShiftTable` holds accuracy, NLL, ECE and Brier per kind and severity and their mean over kinds; with
``ci=`` each value gets a bootstrap interval over the test examples (the mean over kinds resamples the same
examples in every kind, so its interval is paired across kinds).

Example:
    >>> table = posthoc.evaluate_shift([plain, laplace], test_loader, kinds=["gaussian-noise", "rotate"],
    ...                                severities=[1, 3, 5], normalization=((0.1307,), (0.3081,)))
    >>> print(table.to_markdown())
    >>> table.plot("shift.png")
    >>> table.confidence_plot("confidence.png", plain_and_best(table))   # the plain model against the best
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from matplotlib.figure import Figure

from posthoc.core.errors import ConfigError, InputError
from posthoc.core.uncertain_model import UncertainModel
from posthoc.evaluation import bootstrap, plots
from posthoc.evaluation.report import Report, evaluate
from posthoc.shift.kinds import EVALUATION_KINDS
from posthoc.shift.loader import Normalization, check_kind, corrupt

METRICS = ("accuracy", "nll", "ece", "brier")
DEFAULT_KINDS = EVALUATION_KINDS
CLEAN = "clean"
MEAN = "mean"
#: labels the plain (unwrapped-equivalent) model goes by: ``posthoc evaluate``'s and ``posthoc demo``'s
PLAIN_LABELS = ("none", "MAP")
#: ``method -> kind ("clean", a corruption, or "mean") -> severity -> metric -> value``
Values = dict[str, dict[str, dict[int, dict[str, float]]]]
Bounds = dict[str, dict[str, dict[int, dict[str, tuple[float, float]]]]]


@dataclass
class ShiftTable:
    """Metrics per method, kind and severity (severity 0 is the clean test set, kind ``"clean"``), plus
    their mean over kinds (kind ``"mean"``); ``intervals`` mirrors ``values`` when evaluated with ``ci``;
    ``reports`` keeps each method's :class:`Report` per ``(kind, severity)`` (for reliability diagrams)."""

    kinds: tuple[str, ...]
    severities: tuple[int, ...]
    values: Values
    intervals: Bounds = field(default_factory=dict)
    ci: float | None = None
    reports: dict[str, dict[tuple[str, int], Report]] = field(default_factory=dict, repr=False)

    @classmethod
    def merge(cls, tables: Sequence["ShiftTable"]) -> "ShiftTable":
        """One table of the methods of several tables with the same kinds and severities (e.g. one per demo row)."""
        first = tables[0]
        if any((t.kinds, t.severities, t.ci) != (first.kinds, first.severities, first.ci) for t in tables):
            raise ConfigError("only tables with the same kinds, severities and ci can be merged")
        return cls(first.kinds, first.severities, {k: v for t in tables for k, v in t.values.items()},
                   {k: v for t in tables for k, v in t.intervals.items()}, first.ci,
                   {k: v for t in tables for k, v in t.reports.items()})

    @classmethod
    def join(cls, tables: Sequence["ShiftTable"]) -> "ShiftTable":
        """One table of the same methods and kinds at the severities of all ``tables`` together (e.g. severities
        1, 3, 5 from one run and 2, 4 from another); the clean cell is the first table's; no intervals (the
        tables' bootstrap resamples differ).

        Example:
            >>> ShiftTable.join([table_135, table_24]).severities
            (1, 2, 3, 4, 5)
        """
        first = tables[0]
        if any((set(t.values), t.kinds) != (set(first.values), first.kinds) for t in tables):
            raise ConfigError("only tables of the same methods and kinds can be joined")
        severities = tuple(sorted({s for t in tables for s in t.severities}))
        values: Values = {m: {CLEAN: first.values[m][CLEAN]} for m in first.values}
        reports: dict[str, dict[tuple[str, int], Report]] = {m: {} for m in first.values}
        for table in reversed(tables):
            for method in first.values:
                for kind in (*first.kinds, MEAN):
                    values[method].setdefault(kind, {}).update(table.values[method][kind])
                reports[method].update(table.reports.get(method, {}))
        for method in first.values:
            for kind in (*first.kinds, MEAN):
                values[method][kind] = dict(sorted(values[method][kind].items()))
        return cls(first.kinds, severities, values, reports=reports)

    @property
    def methods(self) -> list[str]:
        return list(self.values)

    def value(self, method: str, kind: str, severity: int, metric: str) -> float:
        """One cell, e.g. ``table.value("laplace", "mean", 3, "nll")``; ``kind="clean"`` with severity 0."""
        return self.values[method][kind][severity][metric]

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON: kinds, severities, values (and intervals and ci where measured)."""
        out: dict[str, object] = {"kinds": list(self.kinds), "severities": list(self.severities), "values": self.values}
        if self.ci is not None:
            out |= {"ci": self.ci, "intervals": self.intervals}
        return out

    def _cell(self, method: str, kind: str, severity: int, metric: str) -> str:
        text = f"{self.value(method, kind, severity, metric):.4f}"
        bounds = self.intervals.get(method, {}).get(kind, {}).get(severity, {}).get(metric)
        return text if bounds is None else f"{text} [{bounds[0]:.4f}, {bounds[1]:.4f}]"

    def to_markdown(self, metrics: Sequence[str] = ("nll", "ece"), *, detail: bool = False) -> str:
        """The mean over kinds per method and severity, one table per metric; ``detail=True`` adds a long
        table with every kind and severity and all four metrics."""
        parts = []
        for metric in metrics:
            header = ["method", "clean", *(f"severity {s}" for s in self.severities)]
            lines = [f"**{metric.upper()}**, mean over {', '.join(self.kinds)}", "",
                     "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for method in self.values:
                cells = [self._cell(method, CLEAN, 0, metric), *(self._cell(method, MEAN, s, metric) for s in self.severities)]
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            parts.append("\n".join(lines))
        if detail:
            header = ["method", "kind", "severity", "acc", "NLL", "ECE", "Brier"]
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for method in self.values:
                for kind in (CLEAN, *self.kinds, MEAN):
                    for severity in self.values[method][kind]:
                        cells = [self._cell(method, kind, severity, m) for m in METRICS]
                        lines.append(f"| {method} | {kind} | {severity} | " + " | ".join(cells) + " |")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    def plot(self, path: str | os.PathLike | None = None, metrics: Sequence[str] = ("nll", "ece")) -> Figure:
        """Each metric (mean over kinds) against severity, one line per method, the interval as a band."""
        series = {}
        for method, by_kind in self.values.items():
            points = [(0, by_kind[CLEAN][0]), *((s, by_kind[MEAN][s]) for s in self.severities)]
            bounds = self.intervals.get(method)
            series[method] = {}
            for metric in metrics:
                lows = highs = None
                if bounds:
                    pairs = [bounds[CLEAN][0][metric], *(bounds[MEAN][s][metric] for s in self.severities)]
                    lows, highs = [p[0] for p in pairs], [p[1] for p in pairs]
                series[method][metric] = ([s for s, _ in points], [v[metric] for _, v in points], lows, highs)
        return plots.shift_plot(series, path, metrics)

    def confidence(self, method: str, kind: str, severity: int) -> float:
        """Mean top-class probability of one cell (kinds as in :meth:`value`; ``"mean"`` averages the kinds).

        Needs the reports (kept by :func:`evaluate_shift`, not by a table rebuilt from JSON).

        Example:
            >>> table.confidence("MAP", "rotate", 5) > table.value("MAP", "rotate", 5, "accuracy")   # overconfident
            True
        """
        reports = self.reports.get(method)
        if not reports:
            raise ConfigError(f"no predictions kept for {method!r}: confidence needs a table made by evaluate_shift")
        if kind == MEAN:
            return sum(self.confidence(method, k, severity) for k in self.kinds) / len(self.kinds)
        return float(reports[kind, severity].probs.max(-1).values.float().mean())

    def confidence_series(self, method: str) -> tuple[list[int], list[float], list[float]]:
        """``(severities, mean confidence, accuracy)`` from clean (severity 0) up, both means over the kinds."""
        severities = [0, *self.severities]
        keys = [(CLEAN, 0), *((MEAN, s) for s in self.severities)]
        return (severities, [self.confidence(method, *key) for key in keys],
                [self.value(method, kind, severity, "accuracy") for kind, severity in keys])

    def best_method(self, exclude: Sequence[str] = ()) -> str:
        """The method with the lowest NLL, mean over the kinds, at the highest severity (``exclude`` left out).

        Example:
            >>> table.best_method(exclude=["MAP"])
            'laplace'
        """
        top = max(self.severities)
        candidates = [m for m in self.values if m not in exclude] or list(self.values)
        return min(candidates, key=lambda m: self.value(m, MEAN, top, "nll"))

    def confidence_plot(self, path: str | os.PathLike | None = None, methods: Sequence[str] | None = None) -> Figure:
        """Mean confidence and accuracy (means over the kinds) against severity for ``methods`` (default: all),
        the gap shaded (see :func:`posthoc.evaluation.plots.confidence_plot`)."""
        chosen = list(methods or self.values)
        return plots.confidence_plot({m: self.confidence_series(m) for m in chosen}, path,
                                     title=f"mean over {', '.join(self.kinds)}")


def plain_and_best(table: ShiftTable, best: str | None = None) -> list[str]:
    """The plain model (a method labelled one of :data:`PLAIN_LABELS`, when the table has one) and the best
    other method (``best``, or :meth:`ShiftTable.best_method`): the pair a confidence plot compares.

    Example:
        >>> plain_and_best(table)
        ['MAP', 'laplace + temperature']
    """
    plain = next((m for m in table.methods if m in PLAIN_LABELS), None)
    if best is not None and best not in table.values:
        raise ConfigError(f"no method {best!r} in the shift table; methods: {', '.join(table.methods)}")
    best = best or (table.best_method(exclude=[plain]) if plain is None or len(table.methods) > 1 else None)
    return [m for m in dict.fromkeys((plain, best)) if m is not None]


def _named(um_or_list: UncertainModel | Sequence[UncertainModel] | Mapping[str, UncertainModel]) -> dict[str, UncertainModel]:
    if isinstance(um_or_list, UncertainModel):
        um_or_list = [um_or_list]
    if isinstance(um_or_list, Mapping):
        return dict(um_or_list)
    named: dict[str, UncertainModel] = {}
    for um in um_or_list:
        if not isinstance(um, UncertainModel):
            raise InputError(f"evaluate_shift takes wrapped models (posthoc.wrap(...)), got {type(um).__name__}")
        base = name = "+".join(um.methods)
        count = 1
        while name in named:
            count += 1
            name = f"{base} ({count})"
        named[name] = um
    return named


def _metrics_of(report: Report) -> dict[str, float]:
    return {metric: getattr(report, metric) for metric in METRICS}


def evaluate_shift(um_or_list: UncertainModel | Sequence[UncertainModel] | Mapping[str, UncertainModel],
                   test_loader: Iterable, *, kinds: Sequence[str] = DEFAULT_KINDS,
                   severities: Sequence[int] = (1, 2, 3, 4, 5), normalization: Normalization | None = None,
                   seed: int = 0, ci: float | None = None, bootstraps: int = 1000, num_samples: int | None = None,
                   progress: bool = True) -> ShiftTable:
    """Evaluate each wrapped model on the clean and corrupted test set (see the module docs).

    ``um_or_list``: one wrapped model, a list (named by their methods) or a dict ``name -> model``.
    ``normalization=(mean, std)``: the model's input normalisation, so corruptions happen in pixel space
    (see :func:`posthoc.shift.corrupt`). The test loader must yield the same examples in the same order on
    every pass (no shuffling), so that every kind and method is scored on the same examples.

    Example:
        >>> table = posthoc.evaluate_shift(um, test_loader, kinds=["contrast"], severities=[1, 5])
        >>> table.value(table.methods[0], "contrast", 5, "nll") > table.value(table.methods[0], "clean", 0, "nll")
        True
    """
    if not kinds or not severities:
        raise ConfigError("evaluate_shift needs at least one kind and one severity")
    for kind in kinds:
        for severity in severities:
            check_kind(kind, severity)
    if ci is not None:
        bootstrap.check_level(ci, bootstraps)
    values: Values = {}
    bounds: Bounds = {}
    kept: dict[str, dict[tuple[str, int], Report]] = {}
    for name, um in _named(um_or_list).items():
        def run(loader: Iterable) -> Report:
            return evaluate(um, loader, name=name, progress=progress, num_samples=num_samples, seed=seed)

        reports = {(CLEAN, 0): run(test_loader)}
        for kind in kinds:
            for severity in severities:
                reports[kind, severity] = run(corrupt(test_loader, kind, severity, seed, normalization=normalization))
        kept[name] = reports
        values[name] = {CLEAN: {0: _metrics_of(reports[CLEAN, 0])}}
        for kind in kinds:
            values[name][kind] = {s: _metrics_of(reports[kind, s]) for s in severities}
        values[name][MEAN] = {s: {m: sum(values[name][k][s][m] for k in kinds) / len(kinds) for m in METRICS}
                              for s in severities}
        if ci is not None:
            bounds[name] = _intervals(reports, kinds, severities, ci, bootstraps, seed)
    return ShiftTable(tuple(kinds), tuple(severities), values, bounds, ci, kept)


def _intervals(reports: dict[tuple[str, int], Report], kinds: Sequence[str], severities: Sequence[int], ci: float,
               bootstraps: int, seed: int) -> dict[str, dict[int, dict[str, tuple[float, float]]]]:
    """Bootstrap intervals of every cell and of the mean over kinds, all on one shared resample of the examples."""
    labels = reports[CLEAN, 0].labels
    for report in reports.values():
        if not torch.equal(report.labels, labels):
            raise InputError("the test loader yielded different examples on different passes; evaluate_shift needs "
                             "a loader without shuffling")
    index = bootstrap.resample_index(len(labels), bootstraps, seed)
    draws = {key: bootstrap.draws(bootstrap.example_statistics(report.probs, report.labels), index, METRICS)
             for key, report in reports.items()}

    def cell(by_metric: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
        return {metric: bootstrap.percentile_interval(by_metric[metric], ci) for metric in METRICS}

    out = {CLEAN: {0: cell(draws[CLEAN, 0])}}
    for kind in kinds:
        out[kind] = {s: cell(draws[kind, s]) for s in severities}
    # the same resampled examples in every kind: the mean over kinds of each resample's values
    out[MEAN] = {s: cell({m: np.mean([draws[k, s][m] for k in kinds], axis=0) for m in METRICS}) for s in severities}
    return out
