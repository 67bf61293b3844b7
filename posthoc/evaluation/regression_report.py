"""``posthoc.evaluate`` for a regressor: run it over a test loader and summarise it in a :class:`RegressionReport`.

The report carries the accuracy of the predictive mean (RMSE, MAE), the proper scoring rules (NLL, CRPS),
the coverage and mean width of the central 50 / 90 / 95 % intervals, the interval calibration error (MACE)
and ENCE, all exact for the Gaussian (mixture) predictive (:mod:`~posthoc.evaluation.regression_metrics`).
Given fitted conformal intervals (``posthoc.conformal(um, calibration_loader)``), it also measures their
coverage and mean width on the test set. ``ci=`` adds percentile bootstrap intervals over the test examples.
Given an OOD loader, ``ood_auroc`` ranks the test and OOD inputs by the total predictive variance, and ``ood``
holds every OOD score's AUROC, AUPR and FPR@95 (the variance, and the ``ood_scores`` asked for: a fitted
``posthoc.detector(um, score=["knn", "mahalanobis"])``; :meth:`RegressionReport.ood_to_markdown`).

Apart from :mod:`~posthoc.evaluation.report` because its columns differ (RMSE, CRPS, interval coverage and width
against accuracy, ECE, AURC and OOD AUROC); both share the bootstrap, the tables and the HTML page.

Example:
    >>> import posthoc
    >>> from posthoc.demo.examples import regression_um, reg_test_loader, reg_val_loader
    >>> report = posthoc.evaluate(regression_um, reg_test_loader, ci=0.95)   # wrapped with likelihood="regression"
    >>> print(report.to_markdown())
    | method | RMSE | MAE | NLL | CRPS | cov 50% | width 50% | cov 90% | width 90% | cov 95% | width 95% | MACE | ENCE |
    |---|---|---|---|---|---|---|---|---|---|---|---|---|
    | laplace | 0.1619 [0.1477, 0.1760] | 0.1351 [0.1229, 0.1473] | -0.3941 [-0.4943, -0.2851] | ...
    >>> fig = report.calibration_curve("calibration.png")
    >>> fig = report.error_against_std("error_std.png")
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)
    >>> posthoc.evaluate(regression_um, reg_test_loader, conformal=cp).coverage       # about 0.9
    0.87
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor

from posthoc.core.regression_prediction import RegressionPrediction
from posthoc.engine.predictions import predict_regression_loader
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError
from posthoc.evaluation import bootstrap, html_page, metrics, regression_metrics, regression_plots
from posthoc.evaluation.ood_report import OODValues, ood_markdown, scoring_detector
from posthoc.evaluation.regression_bootstrap import interval_statistics, level_name, regression_statistics
from posthoc.evaluation.regression_metrics import LEVELS, components
from posthoc.evaluation.table import bold_best, cell, markdown_rows, outside_note, shared_level
from posthoc.guarantees.regression_conformal import ConformalRegressor


def interval_columns() -> tuple[str, ...]:
    """``coverage_50, width_50, coverage_90, ...``: the interval columns of :data:`LEVELS`, in order."""
    return tuple(f"{what}_{level_name(level)}" for level in LEVELS for what in ("coverage", "width"))


#: bins of predicted std behind ENCE (a test set of fewer points reports it as unavailable)
ENCE_BINS = 10


@dataclass
class RegressionReport:
    """Metrics of one regression predictive on one test set.

    ``rmse`` / ``mae`` of the predictive mean; ``nll`` (mean over examples, joint over outputs) and ``crps``
    (in the targets' units); ``coverage_50`` / ``width_50`` (and ``_90``, ``_95``): the fraction of targets
    inside the central interval of that level and its mean width; ``mace``: mean absolute gap of the
    interval calibration curve; ``ence``: expected normalised calibration error over :data:`ENCE_BINS` bins of
    predicted std (``None``, shown as ``–``, for fewer points than bins: unavailable). Given conformal
    intervals at ``alpha``: ``coverage`` and ``width`` of those. ``means`` / ``stds`` ``(K, N, D)`` and
    ``targets`` ``(N, D)`` are kept for the plots. With ``ci=``, ``intervals`` maps each metric to its
    bootstrap interval. Given an OOD set: ``ood_auroc`` (by the total predictive variance) and ``ood``, each OOD
    score's metrics (``ood_values``: its values on the test and OOD sets).
    """

    name: str
    rmse: float
    mae: float
    nll: float
    crps: float
    coverage_50: float
    width_50: float
    coverage_90: float
    width_90: float
    coverage_95: float
    width_95: float
    mace: float
    ence: float | None
    alpha: float | None = None
    coverage: float | None = None
    width: float | None = None
    means: Tensor = field(repr=False, default=None)
    stds: Tensor = field(repr=False, default=None)
    targets: Tensor = field(repr=False, default=None)
    ci: float | None = None
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    ood_auroc: float | None = None
    ood: dict[str, dict[str, float]] | None = None
    ood_values: OODValues | None = field(repr=False, default=None)

    COLUMNS = ("rmse", "mae", "nll", "crps", *interval_columns(), "mace", "ence")
    #: present in :meth:`as_dict` only when the report measured conformal intervals
    GUARANTEE_COLUMNS = ("alpha", "coverage", "width")

    @classmethod
    def from_predictions(
        cls,
        name: str,
        means: Tensor,
        stds: Tensor,
        targets: Tensor,
        *,
        conformal: tuple[Tensor, Tensor] | None = None,
        alpha: float | None = None,
    ) -> RegressionReport:
        """Every metric of a predictive ``(means, stds)`` ``(K, N, D)`` on ``targets`` (and of conformal
        ``(lower, upper)`` intervals at ``alpha``, if given).

        Example:
            >>> import torch
            >>> from posthoc.evaluation.regression_report import RegressionReport
            >>> RegressionReport.from_predictions("MAP", torch.zeros(1, 4, 1), torch.ones(1, 4, 1), torch.zeros(4)).rmse
            0.0
        """
        targets = regression_metrics.as_targets(means, targets)
        values = {}
        for level in LEVELS:
            covered, width = regression_metrics.interval_coverage(means, stds, targets, level)
            values |= {f"coverage_{level_name(level)}": covered, f"width_{level_name(level)}": width}
        measured = {}
        if conformal is not None:
            whole = torch.arange(targets.shape[0])[None]
            stats = interval_statistics(*conformal, targets)
            measured = {"alpha": alpha, **{key: float(stat(whole)[0]) for key, stat in stats.items()}}
        return cls(
            name=name,
            rmse=regression_metrics.rmse(means, targets),
            mae=regression_metrics.mae(means, targets),
            nll=regression_metrics.nll(means, stds, targets),
            crps=regression_metrics.crps(means, stds, targets),
            **values,
            mace=regression_metrics.calibration_error(means, stds, targets),
            ence=regression_metrics.ence(means, stds, targets, bins=ENCE_BINS)
            if targets.numel() >= ENCE_BINS
            else None,
            **measured,
            means=means,
            stds=stds,
            targets=targets,
        )

    def as_dict(self) -> dict[str, object]:
        """The metrics by name; the conformal columns only where measured."""
        measured = {c: getattr(self, c) for c in self.GUARANTEE_COLUMNS if getattr(self, c) is not None}
        bounds = {"ci": self.ci, "intervals": {k: list(v) for k, v in self.intervals.items()}} if self.intervals else {}
        ood = {"ood_auroc": self.ood_auroc, "ood": self.ood} if self.ood else {}
        return {**{column: getattr(self, column) for column in self.COLUMNS}, **measured, **bounds, **ood}

    def to_markdown(self) -> str:
        """A one-row Markdown table of the metrics."""
        return regression_markdown_table([self])

    def ood_to_markdown(self) -> str:
        """The OOD scores' table (one line per score), or ``""`` without an OOD set."""
        return ood_markdown({self.name: self.ood}) if self.ood else ""

    def _predictive(self) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        return {self.name: (self.means, self.stds, self.targets)}

    def calibration_curve(self, path: str | os.PathLike | None = None, *, kind: str = "interval") -> Figure:
        """Observed against expected proportions inside central intervals (``kind="quantile"``: below quantiles),
        to a PNG at ``path`` if given."""
        return regression_plots.calibration_curves(self._predictive(), path, kind=kind)

    def error_against_std(self, path: str | os.PathLike | None = None) -> Figure:
        """RMSE against predicted std per bin of std (the picture behind ENCE; fewer bins for fewer points), to a PNG
        at ``path`` if given."""
        return regression_plots.error_against_std(self._predictive(), path, bins=min(ENCE_BINS, self.targets.numel()))

    def _repr_html_(self) -> str:
        """Jupyter's view: the metrics table, the calibration curve and the error against the predicted std."""
        return "\n".join(
            [
                html_page.markdown_to_html(self.to_markdown()),
                html_page.figure_tag(self.calibration_curve(), "calibration curve"),
                html_page.figure_tag(self.error_against_std(), "error against predicted std"),
            ]
        )

    def to_html(self, path: str | os.PathLike) -> Path:
        """Write :meth:`_repr_html_` as one self-contained HTML page (figures embedded); returns the path."""
        return html_page.write_page(path, self._repr_html_(), f"posthoc report: {self.name}")


#: the Markdown headers of :attr:`RegressionReport.COLUMNS`
HEADERS = {
    "rmse": "RMSE",
    "mae": "MAE",
    "nll": "NLL",
    "crps": "CRPS",
    "mace": "MACE",
    "ence": "ENCE",
    **{
        f"{what}_{level_name(level)}": f"{'cov' if what == 'coverage' else 'width'} {level:.0%}"
        for level in LEVELS
        for what in ("coverage", "width")
    },
}


def regression_markdown_table(reports: list[RegressionReport]) -> str:
    """Markdown rows of several regression reports; conformal columns appear when a report measured them; the best
    entry of each ranked column is in bold (:data:`posthoc.evaluation.table.BEST_CAPTION`)."""
    header = ["method", *(HEADERS[c] for c in RegressionReport.COLUMNS)]
    columns = [
        bold_best([cell(getattr(r, c), r.intervals.get(c)) for r in reports], [getattr(r, c) for r in reports], c)
        for c in RegressionReport.COLUMNS
    ]
    rows = [[r.name, *(column[i] for column in columns)] for i, r in enumerate(reports)]
    if any(r.coverage is not None for r in reports):
        header += [f"conformal coverage (alpha{shared_level(reports, 'alpha')})", "conformal width"]
        for row, r in zip(rows, reports):
            row += [cell(r.coverage, r.intervals.get("coverage")), cell(r.width, r.intervals.get("width"))]
    return outside_note(markdown_rows(header, rows))


def _check_options(
    um: UncertainModel, conformal: object, selective: object, ood_loader: object, ood_scores: object
) -> None:
    if ood_scores is not None and ood_loader is None:
        raise ConfigError("ood_scores are measured against an OOD set: pass ood_loader=... as well")
    if selective is not None:
        raise ConfigError("posthoc.selective is for classifiers; evaluate a regressor without selective=")
    if conformal is not None and not isinstance(conformal, ConformalRegressor):
        raise ConfigError(
            "conformal= holds a classifier's conformal sets; calibrate intervals on this regressor: "
            "posthoc.conformal(um, calibration_loader, alpha=...)"
        )
    if conformal is not None and conformal.model is not None and conformal.model is not um:
        raise ConfigError(
            "the conformal intervals were calibrated on another wrapped model; calibrate them on this "
            "one: posthoc.conformal(um, calibration_loader, ...)"
        )


def evaluate_regression(
    um: UncertainModel,
    test_loader: Iterable,
    ood_loader: Iterable | None = None,
    *,
    name: str | None = None,
    progress: bool = True,
    num_samples: int | None = None,
    seed: int = 0,
    conformal: ConformalRegressor | None = None,
    selective: object = None,
    ood_scores: object = None,
    ci: float | None = None,
    bootstraps: int = 1000,
) -> RegressionReport:
    """:func:`posthoc.evaluate` for a model wrapped with a regression likelihood (same arguments).

    ``selective`` is refused (it is for classifiers). ``ood_loader`` (labels ignored) adds ``ood_auroc`` by the
    total predictive variance; ``ood_scores`` more scores of a regressor (``"variance"``, or a fitted
    ``posthoc.detector(um, score=["knn", "mahalanobis"]).fit(train_loader)``).

    Example:
        >>> from posthoc.evaluation.regression_report import evaluate_regression
        >>> from posthoc.demo.examples import regression_um, reg_test_loader
        >>> low, high = evaluate_regression(regression_um, reg_test_loader, ci=0.9, progress=False).intervals["crps"]
        >>> 0 < low < high
        True
    """
    _check_options(um, conformal, selective, ood_loader, ood_scores)
    if ci is not None:
        bootstrap.check_level(ci, bootstraps)
    generator = torch.Generator(device=um.device).manual_seed(seed)
    pred, targets = predict_regression_loader(
        um, test_loader, progress=progress, num_samples=num_samples, generator=generator
    )
    means, stds = components(pred)
    bounds = None if conformal is None else conformal.intervals(pred)
    report = RegressionReport.from_predictions(
        name or "+".join(um.methods),
        means,
        stds,
        targets,
        conformal=bounds,
        alpha=None if conformal is None else conformal.alpha,
    )
    if ood_loader is not None:
        report.ood_values = _ood_values(
            um,
            pred,
            test_loader,
            ood_loader,
            ood_scores,
            progress=progress,
            num_samples=num_samples,
            generator=generator,
        )
        report.ood = {score: metrics.ood_metrics(*pair) for score, pair in report.ood_values.items()}
        report.ood_auroc = report.ood["variance"]["auroc"]
    if ci is not None:
        stats = regression_statistics(means, stds, targets)
        if bounds is not None:
            stats |= interval_statistics(*bounds, report.targets)
        report.ci = ci
        report.intervals = bootstrap.intervals(stats, len(targets), ci=ci, bootstraps=bootstraps, seed=seed)
    return report


def _ood_values(
    um: UncertainModel,
    test: RegressionPrediction,
    test_loader: Iterable,
    ood_loader: Iterable,
    ood_scores: object,
    *,
    progress: bool,
    num_samples: int | None,
    generator: torch.Generator,
) -> OODValues:
    """Per OOD score, its values ``(on the test set, on the OOD set)``: ``um``'s total predictive variance, then the
    detector scores of ``ood_scores`` (names of scores that need no fit, or a fitted ``posthoc.detector``)."""
    ood, _ = predict_regression_loader(
        um, ood_loader, labelled=False, progress=progress, num_samples=num_samples, generator=generator, desc="OOD"
    )
    values = {"variance": (test.variance.sum(-1), ood.variance.sum(-1))}
    if ood_scores is None:
        return values
    scorer = scoring_detector(um, ood_scores)
    if not scorer.regression:
        raise ConfigError(
            "ood_scores holds a classifier's detector; fit one on this regressor: "
            "posthoc.detector(um, score=['knn', 'mahalanobis']).fit(train_loader)"
        )
    names = [name for name in scorer.names if not (name == "variance" and scorer.um is um)]
    if names:
        on_test = scorer.score_loader(test_loader, names, progress=progress, generator=generator)
        on_ood = scorer.score_loader(ood_loader, names, progress=progress, generator=generator)
        values.update({name: (on_test[name], on_ood[name]) for name in names})
    return values
