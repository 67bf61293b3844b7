"""``posthoc.evaluate_shift``: one or several wrapped models on a test set corrupted by kind and severity, or on
named shifted test sets.

Each method is evaluated on the clean test set (severity 0) and on ``posthoc.shift.corrupt(test_loader, kind,
severity)`` for every kind and severity (the same seeded corruption for every method); the :class:`ShiftTable` holds
the metrics per kind and severity and their mean over kinds. With ``ci=``, the mean over kinds resamples the same
examples in every kind, so its interval is paired across kinds.

Tabular or 1-D inputs have no corruptions; their shift is a choice of test rows (``posthoc.shift.extrapolation_split``,
``gap_split``). A dict ``{"random": loader, "extrapolation": loader2}`` in place of the test loader evaluates every
method on each named test set: the table's kinds are the names, at severity 0, with no clean cell and no mean.

A dense classifier (``posthoc.wrap(model, dense=True)``: a segmentation map) gets the per-position metrics of
:func:`~posthoc.evaluation.dense.dense_metrics` (:data:`DENSE_METRICS`) on the corruptions that move no pixel, so that
the label maps still line up with the corrupted images (default :data:`~posthoc.shift.kinds.DENSE_EVALUATION_KINDS`;
the moving kinds, rotate and translate, are refused). Its cells keep no per-example predictions, so ``ci=``, the
verdict (:meth:`ShiftTable.example_nll`) and the confidence series are for models of one label per input.

Example:
    >>> import posthoc
    >>> from posthoc.evaluation.shift import plain_and_best
    >>> from posthoc_apps.demo.examples import cnn, digits, digits_test_loader
    >>> from posthoc_apps.demo.data import MEAN, STD, loader, subset       # the bundled digits, cnn: their CNN
    >>> plain = posthoc.wrap(cnn, method="none")
    >>> laplace = posthoc.wrap(cnn, method="laplace").fit(loader(subset(digits.fit, 600)),
    ...                                                  loader(subset(digits.calibration, 200)))
    >>> table = posthoc.evaluate_shift({"MAP": plain, "laplace": laplace}, digits_test_loader,
    ...                                kinds=["gaussian-noise", "rotate"], severities=[1, 3, 5],
    ...                                normalization=((MEAN,), (STD,)))
    >>> print(table.to_markdown())
    **NLL**, mean over gaussian-noise, rotate
    <BLANKLINE>
    | method | clean | severity 1 | severity 3 | severity 5 |
    |---|---|---|---|---|
    | MAP | **0.0197** | **0.0986** | 1.3025 | 3.6088 |
    | laplace | 0.0298 | 0.1000 | **1.0844** | **2.9745** |
    ...
    >>> plain_and_best(table)                       # the pair a confidence plot compares
    ['MAP', 'laplace']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from posthoc.core.checks import integer
from posthoc.engine.uncertain_model import UncertainModel, check_wrapped
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap
from posthoc.evaluation.comparison import example_nll
from posthoc.evaluation.dense import evaluate_dense
from posthoc.evaluation.gaussian_report import COLUMN_HEADERS
from posthoc.evaluation.report import Report, evaluate
from posthoc.evaluation.table import bold_best, cell, outside_note
from posthoc.guarantees.sources import is_regression
from posthoc.shift.kinds import DENSE_EVALUATION_KINDS, EVALUATION_KINDS, MOVING_KINDS
from posthoc.shift.kinds import KINDS as CORRUPTION_NAMES
from posthoc.shift.loader import PIXELS, Normalization, check_kind, corrupt

METRICS = ("accuracy", "nll", "ece", "brier")
#: a regressor's cells: proper scores, accuracy of the mean, the central 90 % interval, interval calibration
REGRESSION_METRICS = ("nll", "crps", "rmse", "coverage_90", "width_90", "mace")
#: a dense classifier's cells, per position (the table's names of :data:`posthoc.evaluation.dense.DENSE_METRICS`)
DENSE_NAMES = {
    "accuracy": "accuracy",
    "nll": "NLL",
    "ece": "ECE",
    "brier": "Brier",
    "miou": "mIoU",
    "auroc_error": "AUROC(error)",
}
DENSE_METRICS = tuple(DENSE_NAMES)
#: the metrics :meth:`ShiftTable.to_markdown` and its plot (``posthoc_apps.report.shift_plot``) show by default
HEADLINE = {
    METRICS: ("nll", "ece"),
    REGRESSION_METRICS: ("nll", "crps", "coverage_90"),
    DENSE_METRICS: ("nll", "ece", "miou"),
}
#: the metrics' names in the long table, and in titles and axis labels
DENSE_LABELS = {"miou": "mIoU", "auroc_error": "AUROC(error)"}
LABELS = {"accuracy": "acc", "nll": "NLL", "ece": "ECE", "brier": "Brier", **COLUMN_HEADERS, **DENSE_LABELS}
TITLES = {**{metric: metric.upper() for metric in METRICS}, **COLUMN_HEADERS, **DENSE_LABELS}
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
    """Metrics per method, kind and severity (kind ``"clean"`` at severity 0), plus their mean over kinds (kind
    ``"mean"``); ``intervals`` mirrors ``values`` with ``ci``; ``reports`` keeps each :class:`Report` per
    ``(kind, severity)``. A table of named test sets (:attr:`named`) has no severities."""

    kinds: tuple[str, ...]
    severities: tuple[int, ...]
    values: Values
    intervals: Bounds = field(default_factory=dict)
    ci: float | None = None
    reports: dict[str, dict[tuple[str, int], Report]] = field(default_factory=dict, repr=False)
    metrics: tuple[str, ...] = METRICS

    @classmethod
    def merge(cls, tables: Sequence[ShiftTable]) -> ShiftTable:
        """One table of the methods of several tables with the same kinds and severities (e.g. one per demo row)."""
        first = _first_table(tables, "merge")
        if any(
            (t.kinds, t.severities, t.ci, t.metrics) != (first.kinds, first.severities, first.ci, first.metrics)
            for t in tables
        ):
            raise ConfigError(
                "only tables with the same kinds, severities, ci and metrics (classifiers or regressors) can be merged"
            )
        return cls(
            first.kinds,
            first.severities,
            {k: v for t in tables for k, v in t.values.items()},
            {k: v for t in tables for k, v in t.intervals.items()},
            first.ci,
            {k: v for t in tables for k, v in t.reports.items()},
            first.metrics,
        )

    @classmethod
    def join(cls, tables: Sequence[ShiftTable]) -> ShiftTable:
        """One table of the same methods and kinds at the severities of all ``tables`` together; the clean cell is the
        first table's; no intervals (the tables' bootstrap resamples differ).

        Example:
            >>> import posthoc
            >>> from posthoc.evaluation.shift import ShiftTable
            >>> from posthoc_apps.demo.examples import cnn, digits_test_loader
            >>> plain = posthoc.wrap(cnn, method="none")
            >>> rotate = dict(kinds=["rotate"], normalization=((0.1307,), (0.3081,)))
            >>> table_135 = posthoc.evaluate_shift(plain, digits_test_loader, severities=[1, 3, 5], **rotate)
            >>> table_24 = posthoc.evaluate_shift(plain, digits_test_loader, severities=[2, 4], **rotate)
            >>> ShiftTable.join([table_135, table_24]).severities
            (1, 2, 3, 4, 5)
        """
        first = _first_table(tables, "join")
        if any(t.named for t in tables):
            raise ConfigError(
                "tables of named test sets have no severities to join; merge them (ShiftTable.merge) instead"
            )
        if any((set(t.values), t.kinds, t.metrics) != (set(first.values), first.kinds, first.metrics) for t in tables):
            raise ConfigError("only tables of the same methods and kinds, with the same metrics, can be joined")
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
        return cls(first.kinds, severities, values, reports=reports, metrics=first.metrics)

    @property
    def methods(self) -> list[str]:
        return list(self.values)

    @property
    def named(self) -> bool:
        """Whether the kinds are named test sets (no severities, no clean cell, no mean over kinds)."""
        return not self.severities

    def value(self, method: str, kind: str, severity: int, metric: str) -> float:
        """One cell, e.g. ``table.value("laplace", "mean", 3, "nll")``; ``kind="clean"`` with severity 0. A method,
        kind, severity or metric the table does not hold is refused with the ones it does."""
        for key, held, what in (
            (method, self.values, "method"),
            (kind, self.values.get(method, {}), "kind"),
            (severity, self.values.get(method, {}).get(kind, {}), "severity"),
        ):
            if key not in held:
                raise ConfigError(f"this table has no {what} {key!r}; its {what}s: {', '.join(map(str, held))}")
        self.chosen_metrics([metric])
        return self.values[method][kind][severity][metric]

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON: kinds, severities, values (and intervals and ci where measured)."""
        out: dict[str, object] = {
            "kinds": list(self.kinds),
            "severities": list(self.severities),
            "metrics": list(self.metrics),
            "values": self.values,
        }
        if self.ci is not None:
            out |= {"ci": self.ci, "intervals": self.intervals}
        return out

    def _cell(self, method: str, kind: str, severity: int, metric: str) -> str:
        bounds = self.intervals.get(method, {}).get(kind, {}).get(severity, {}).get(metric)
        return cell(self.value(method, kind, severity, metric), bounds)

    def _marked(self, methods: list[str], kind: str, severity: int, metric: str) -> list[str]:
        """The cells of ``methods`` at one kind, severity and metric, the best in bold (a column of methods)."""
        return bold_best(
            [self._cell(m, kind, severity, metric) for m in methods],
            [self.value(m, kind, severity, metric) for m in methods],
            metric,
        )

    def to_markdown(self, metrics: Sequence[str] | None = None, *, detail: bool = False) -> str:
        """One table per metric (default: :data:`HEADLINE`): the mean over kinds per method and severity (or the
        value per named set); ``detail=True`` adds a long table of every kind, severity and metric. The best of each
        column is in bold."""
        metrics = self.chosen_metrics(metrics)
        parts = []
        for metric in metrics:
            if self.named:
                header = ["method", *self.kinds]
                title = f"**{TITLES.get(metric, metric)}** per test set"
                keys = [(kind, 0) for kind in self.kinds]
            else:
                header = ["method", "clean", *(f"severity {s}" for s in self.severities)]
                title = f"**{TITLES.get(metric, metric)}**, mean over {', '.join(self.kinds)}"
                keys = [(CLEAN, 0), *((MEAN, s) for s in self.severities)]
            lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            columns = [self._marked(list(self.values), *key, metric) for key in keys]
            for row, method in enumerate(self.values):
                lines.append(f"| {method} | " + " | ".join(column[row] for column in columns) + " |")
            parts.append("\n".join(lines))
        if detail:
            header = [
                "method",
                "test set" if self.named else "kind",
                *([] if self.named else ["severity"]),
                *(LABELS.get(m, m) for m in self.metrics),
            ]
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            methods = list(self.values)
            marked = {
                (kind, severity): [self._marked(methods, kind, severity, m) for m in self.metrics]
                for kind in self.values[methods[0]]
                for severity in self.values[methods[0]][kind]
            }
            for row, method in enumerate(methods):
                for kind in self.values[method]:
                    for severity in self.values[method][kind]:
                        cells = [column[row] for column in marked[kind, severity]]
                        where = kind if self.named else f"{kind} | {severity}"
                        lines.append(f"| {method} | {where} | " + " | ".join(cells) + " |")
            parts.append("\n".join(lines))
        return outside_note("\n\n".join(parts))

    def example_nll(self, method: str) -> dict[str, torch.Tensor]:
        """Per shift, ``method``'s per-example NLL, for the verdict: ``"severity S"`` -> the mean over the kinds of
        each example's NLL at severity ``S``, or per named test set its own.

        Example:
            >>> from posthoc_apps.demo.examples import shift_table
            >>> {name: values.shape for name, values in shift_table.example_nll("laplace").items()}
            {'severity 1': torch.Size([200]), 'severity 3': torch.Size([200]), 'severity 5': torch.Size([200])}
        """
        if method not in self.methods:
            raise ConfigError(f"this table has no method {method!r}; its methods: {', '.join(self.methods)}")
        self._refuse_dense("the per-example NLL")
        reports = self.reports.get(method)
        if not reports:
            raise ConfigError(f"no predictions kept for {method!r}: the verdict needs a table made by evaluate_shift")
        if self.named:
            return {kind: example_nll(reports[kind, 0]) for kind in self.kinds}
        return {
            f"severity {s}": torch.stack([example_nll(reports[kind, s]) for kind in self.kinds]).mean(0)
            for s in self.severities
        }

    def _refuse_dense(self, what: str) -> None:
        if self.metrics == DENSE_METRICS:
            raise ConfigError(
                f"{what} needs the predictions of each example, which a dense model's table does not keep (its cells "
                "are per-position metrics): read table.value(method, kind, severity, metric)"
            )

    def chosen_metrics(self, metrics: Sequence[str] | None = None) -> Sequence[str]:
        """``metrics`` checked against the table's (default: its :data:`HEADLINE` metrics)."""
        chosen = HEADLINE[self.metrics] if metrics is None else metrics
        unknown = [m for m in chosen if m not in self.metrics]
        if unknown:
            raise ConfigError(f"this table has no {unknown}; its metrics: {', '.join(self.metrics)}")
        return chosen

    def confidence(self, method: str, kind: str, severity: int) -> float:
        """Mean top-class probability of one cell (kinds as in :meth:`value`; ``"mean"`` averages the kinds).

        Example:
            >>> from posthoc_apps.demo.examples import shift_table
            >>> shift_table.confidence("MAP", "rotate", 5), shift_table.value("MAP", "rotate", 5, "accuracy")   # overconfident
            (0.79, 0.11)
        """
        self._refuse_dense("confidence")
        if self.metrics != METRICS:
            raise ConfigError(
                "confidence is a classifier's top-class probability; a regressor's table holds the 90 % "
                "interval's coverage and width instead: table.value(method, kind, severity, 'coverage_90')"
            )
        if method not in self.methods:
            raise ConfigError(f"this table has no method {method!r}; its methods: {', '.join(self.methods)}")
        reports = self.reports.get(method)
        if not reports:
            raise ConfigError(f"no predictions kept for {method!r}: confidence needs a table made by evaluate_shift")
        if kind == MEAN:
            return sum(self.confidence(method, k, severity) for k in self.kinds) / len(self.kinds)
        return float(reports[kind, severity].probs.max(-1).values.float().mean())

    def confidence_series(self, method: str) -> tuple[list[int], list[float], list[float]]:
        """``(severities, mean confidence, accuracy)`` from clean (severity 0) up, both means over the kinds."""
        if self.named:
            raise ConfigError(
                "named test sets have no severities to follow confidence along; read "
                "table.confidence(method, name, 0) per set"
            )
        severities = [0, *self.severities]
        keys = [(CLEAN, 0), *((MEAN, s) for s in self.severities)]
        return (
            severities,
            [self.confidence(method, *key) for key in keys],
            [self.value(method, kind, severity, "accuracy") for kind, severity in keys],
        )

    def best_method(self, exclude: Sequence[str] = ()) -> str:
        """The method with the lowest NLL, mean over the kinds, at the highest severity (``exclude`` left out);
        for named test sets, the lowest NLL averaged over the sets."""
        if isinstance(exclude, str):
            raise ConfigError(
                f"exclude is a list of method names, e.g. exclude=[{exclude!r}], got the string {exclude!r}"
            )
        unknown = [m for m in exclude if m not in self.values]
        if unknown:
            raise ConfigError(
                f"exclude names no method of this table: {unknown}; pass a list of its methods: "
                f"{', '.join(self.methods)}"
            )
        candidates = [m for m in self.values if m not in exclude] or list(self.values)
        if self.named:
            return min(candidates, key=lambda m: sum(self.value(m, k, 0, "nll") for k in self.kinds) / len(self.kinds))
        top = max(self.severities)
        return min(candidates, key=lambda m: self.value(m, MEAN, top, "nll"))


def _first_table(tables: Sequence[ShiftTable], what: str) -> ShiftTable:
    """The first of ``tables`` (a non-empty sequence of :class:`ShiftTable`) for :meth:`ShiftTable.merge` / ``join``."""
    if (
        isinstance(tables, ShiftTable)
        or not isinstance(tables, Sequence)
        or not tables
        or not all(isinstance(t, ShiftTable) for t in tables)
    ):
        raise ConfigError(
            f"ShiftTable.{what} takes a non-empty list of ShiftTables, e.g. ShiftTable.{what}([a, b]); got "
            f"{tables!r:.80}"
        )
    return tables[0]


def plain_and_best(table: ShiftTable, best: str | None = None) -> list[str]:
    """The plain model (a method labelled one of :data:`PLAIN_LABELS`, when the table has one) and the best
    other method (``best``, or :meth:`ShiftTable.best_method`): the pair a confidence plot compares."""
    plain = next((m for m in table.methods if m in PLAIN_LABELS), None)
    if best is not None and best not in table.values:
        raise ConfigError(f"no method {best!r} in the shift table; methods: {', '.join(table.methods)}")
    best = best or (
        table.best_method(exclude=[] if plain is None else [plain]) if plain is None or len(table.methods) > 1 else None
    )
    return [m for m in dict.fromkeys((plain, best)) if m is not None]


def _named(
    um_or_list: UncertainModel | Sequence[UncertainModel] | Mapping[str, UncertainModel],
) -> dict[str, UncertainModel]:
    if isinstance(um_or_list, nn.Module):  # one model (check_wrapped names what a plain or dense one needs)
        um_or_list = [um_or_list]
    if isinstance(um_or_list, (Sequence, Mapping)) and not isinstance(um_or_list, str) and not um_or_list:
        raise InputError("evaluate_shift got no models; pass a wrapped model, a list of them or a dict name -> model")
    if isinstance(um_or_list, Mapping):
        return {name: check_wrapped(um, f"evaluate_shift (model {name!r})") for name, um in um_or_list.items()}
    named: dict[str, UncertainModel] = {}
    for um in um_or_list:
        check_wrapped(um, "evaluate_shift")
        base = name = "+".join(um.methods)
        count = 1
        while name in named:
            count += 1
            name = f"{base} ({count})"
        named[name] = um
    return named


def _metrics_of(report: Report, metrics: Sequence[str]) -> dict[str, float]:
    return {metric: getattr(report, metric) for metric in metrics}


def _dense(um: UncertainModel) -> bool:
    """Whether ``um`` is a dense model (``posthoc.wrap(model, dense=True)``)."""
    return bool(getattr(um, "dense_outputs", False))


def _table_metrics(models: Mapping[str, UncertainModel]) -> tuple[str, ...]:
    """:data:`REGRESSION_METRICS` when every model is a regressor, :data:`METRICS` when none is,
    :data:`DENSE_METRICS` when every model is a dense classifier."""
    dense = [_dense(um) for um in models.values()]
    if any(dense):
        if not all(dense):
            raise ConfigError(
                "evaluate_shift compares dense models (metrics per position) with dense models; these models mix "
                "dense and one-label-per-input models: evaluate them in two calls"
            )
        if any(um.regression for um in models.values()):
            raise ConfigError(
                "evaluate_shift does not take a per-pixel regressor yet; posthoc.evaluate(um, loader) measures it on "
                "one loader (corrupt it with posthoc.shift.corrupt(loader, kind, severity))"
            )
        return DENSE_METRICS
    regressors = [is_regression(um) for um in models.values()]
    if any(regressors) and not all(regressors):
        raise ConfigError(
            "evaluate_shift compares classifiers with classifiers and regressors with regressors; "
            "these models mix both: evaluate them in two calls"
        )
    return REGRESSION_METRICS if regressors and all(regressors) else METRICS


def _check_images(test_loader: Iterable, kinds: Sequence[str], who: str) -> None:
    """Refuse, before any evaluation, corruption kinds on test inputs that are not image batches (a regressor's or a
    dense model's)."""
    batch = next(iter(test_loader), None)
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    x = x.get(PIXELS, x) if isinstance(x, Mapping) else x
    if isinstance(x, torch.Tensor) and x.dim() != 4:
        raise InputError(
            f"the corruption kinds ({', '.join(kinds)}) change images (N, C, H, W), but this {who}'s test inputs "
            f"are {tuple(x.shape)}; for tabular, 1-D or token inputs pass named shifted test sets instead: "
            "evaluate_shift(um, {'random': test_loader, 'extrapolation': loader, 'gap': loader}), the "
            "rows chosen by posthoc.shift.extrapolation_split / gap_split"
        )


def _check_dense_kinds(kinds: Sequence[str]) -> None:
    """Refuse the kinds that move pixels for a dense model: its label maps would no longer line up."""
    moving = [kind for kind in kinds if kind in MOVING_KINDS]
    if moving:
        still = ", ".join(k for k in CORRUPTION_NAMES if k not in MOVING_KINDS)
        raise InputError(
            f"{', '.join(moving)} move pixels, so the label maps of a dense model would no longer line up with the "
            f"corrupted images; choose kinds that move no pixel: {still} (default {', '.join(DENSE_EVALUATION_KINDS)})"
        )


def _dense_cells(um: UncertainModel, loader: Iterable, options: Mapping[str, object]) -> dict[str, float]:
    """A dense model's per-position metrics on ``loader`` under the table's names (:data:`DENSE_NAMES`)."""
    generator = torch.Generator(device=um.inner.device).manual_seed(int(options["seed"]))  # type: ignore[arg-type]
    report = evaluate_dense({"model": um}, loader, generator=generator, num_samples=options["num_samples"])
    return {name: report.rows["model"][key] for name, key in DENSE_NAMES.items()}


def evaluate_shift(
    um_or_list: UncertainModel | Sequence[UncertainModel] | Mapping[str, UncertainModel],
    test_loader: Iterable | Mapping[str, Iterable],
    *,
    kinds: Sequence[str] | None = None,
    severities: Sequence[int] | None = None,
    normalization: Normalization | None = None,
    seed: int = 0,
    ci: float | None = None,
    bootstraps: int = 1000,
    num_samples: int | None = None,
    progress: bool = True,
) -> ShiftTable:
    """Evaluate each wrapped model on the clean and corrupted test set, or on named test sets (see the module docs).

    ``um_or_list``: one wrapped model, a list (named by their methods) or a dict ``name -> model``, all
    classifiers, all regressors or all dense classifiers (module docs). ``test_loader``: one loader, corrupted by
    ``kinds`` at ``severities`` (default 1 to 5), or a dict ``name -> loader`` of shifted test sets. ``normalization=(mean, std)``: the model's input
    normalisation, so corruptions happen in pixel space. A loader must yield the same examples in the same order on
    every pass (no shuffling).

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import reg_test_loader, regression_um
        >>> heavy = posthoc.shift.extrapolation_split(*reg_test_loader.dataset.tensors).shifted   # the top 30 % of x
        >>> named = posthoc.evaluate_shift(regression_um, {"random": reg_test_loader, "extrapolation": [heavy]})
        >>> named.value("laplace", "random", 0, "crps"), named.value("laplace", "extrapolation", 0, "crps")
        (0.093, 0.108)
    """
    integer(seed, "seed")
    models = _named(um_or_list)
    metrics = _table_metrics(models)
    if ci is not None:
        if metrics == DENSE_METRICS:
            raise ConfigError(
                "ci= is not available for dense models yet (their cells keep no per-image predictions to resample); "
                "leave ci=None"
            )
        bootstrap.check_level(ci, bootstraps)
    options = {"progress": progress, "num_samples": num_samples, "seed": seed}
    if isinstance(test_loader, Mapping):
        if kinds is not None or severities is not None or normalization is not None:
            raise ConfigError(
                "named test sets are evaluated as they are: leave out kinds, severities and normalization "
                "(they corrupt one test loader)"
            )
        return _evaluate_named(models, test_loader, metrics, ci, bootstraps, options)
    kinds = (DENSE_EVALUATION_KINDS if metrics == DENSE_METRICS else DEFAULT_KINDS) if kinds is None else kinds
    severities = (1, 2, 3, 4, 5) if severities is None else severities
    if not kinds or not severities:
        raise ConfigError("evaluate_shift needs at least one kind and one severity")
    for kind in kinds:
        for severity in severities:
            check_kind(kind, severity)
    if metrics == DENSE_METRICS:
        _check_dense_kinds(kinds)
    if metrics != METRICS:
        _check_images(test_loader, kinds, "regressor" if metrics == REGRESSION_METRICS else "dense model")
    values: Values = {}
    bounds: Bounds = {}
    kept: dict[str, dict[tuple[str, int], Report]] = {}
    loaders = {(CLEAN, 0): test_loader}
    for kind in kinds:
        for severity in severities:
            loaders[kind, severity] = corrupt(test_loader, kind, severity, seed, normalization=normalization)
    for name, um in models.items():
        if metrics == DENSE_METRICS:
            cells = {key: _dense_cells(um, loader, options) for key, loader in loaders.items()}
        else:
            reports = {key: evaluate(um, loader, name=name, **options) for key, loader in loaders.items()}
            kept[name] = reports
            cells = {key: _metrics_of(report, metrics) for key, report in reports.items()}
        values[name] = {CLEAN: {0: cells[CLEAN, 0]}}
        for kind in kinds:
            values[name][kind] = {s: cells[kind, s] for s in severities}
        values[name][MEAN] = {
            s: {m: sum(values[name][k][s][m] for k in kinds) / len(kinds) for m in metrics} for s in severities
        }
        if ci is not None:
            bounds[name] = _intervals(reports, kinds, severities, ci, bootstraps, seed, metrics)
    return ShiftTable(tuple(kinds), tuple(severities), values, bounds, ci, kept, metrics)


def _evaluate_named(
    models: dict[str, UncertainModel],
    loaders: Mapping[str, Iterable],
    metrics: tuple[str, ...],
    ci: float | None,
    bootstraps: int,
    options: dict[str, object],
) -> ShiftTable:
    """Every model on every named test set; with ``ci``, each set's own bootstrap intervals."""
    if not loaders or not all(isinstance(name, str) and name for name in loaders):
        raise ConfigError(
            f"named test sets are a dict of non-empty names to loaders, e.g. {{'random': test_loader, "
            f"'extrapolation': loader}}; got the names {list(loaders)}"
        )
    values: Values = {}
    bounds: Bounds = {}
    kept: dict[str, dict[tuple[str, int], Report]] = {}
    for name, um in models.items():
        if metrics == DENSE_METRICS:
            values[name] = {kind: {0: _dense_cells(um, loader, options)} for kind, loader in loaders.items()}
            continue
        kept[name] = {
            (kind, 0): evaluate(um, loader, name=name, ci=ci, bootstraps=bootstraps, **options)
            for kind, loader in loaders.items()
        }
        values[name] = {kind: {0: _metrics_of(kept[name][kind, 0], metrics)} for kind in loaders}
        if ci is not None:
            bounds[name] = {
                kind: {0: {m: tuple(kept[name][kind, 0].intervals[m]) for m in metrics}} for kind in loaders
            }
    return ShiftTable(tuple(loaders), (), values, bounds, ci, kept, metrics)


def _intervals(
    reports: dict[tuple[str, int], Report],
    kinds: Sequence[str],
    severities: Sequence[int],
    ci: float,
    bootstraps: int,
    seed: int,
    metrics: Sequence[str],
) -> dict[str, dict[int, dict[str, tuple[float, float]]]]:
    """Bootstrap intervals of every cell and of the mean over kinds, all on one shared resample of the examples."""
    observed = [report.observed for report in reports.values()]
    if any(not torch.equal(seen, observed[0]) for seen in observed):
        raise InputError(
            "the test loader yielded different examples on different passes; evaluate_shift needs "
            "a loader without shuffling"
        )
    index = bootstrap.resample_index(len(observed[0]), bootstraps, seed)
    draws = {key: bootstrap.draws(report.example_statistics(), index, metrics) for key, report in reports.items()}

    def bounds_of(by_metric: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
        return {metric: bootstrap.percentile_interval(by_metric[metric], ci) for metric in metrics}

    out = {CLEAN: {0: bounds_of(draws[CLEAN, 0])}}
    for kind in kinds:
        out[kind] = {s: bounds_of(draws[kind, s]) for s in severities}
    # the same resampled examples in every kind: the mean over kinds of each resample's values
    out[MEAN] = {
        s: bounds_of({m: np.mean([draws[k, s][m] for k in kinds], axis=0) for m in metrics}) for s in severities
    }
    return out
