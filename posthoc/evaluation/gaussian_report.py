"""A Gaussian (mixture) predictive's metric set, a regressor's: what :class:`~posthoc.evaluation.report.Report`
measures when ``kind == "gaussian"`` (RMSE, CRPS, interval coverage and width in place of accuracy, ECE and AURC).
Apart from the classifier's set (:class:`~posthoc.evaluation.report.Categorical`) because each metric reads the
Gaussian mixture (:mod:`~posthoc.evaluation.gaussian_metrics`); the report, its Markdown and :func:`posthoc.evaluate`
are written once. Given an OOD loader, ``ood_auroc`` ranks the test and OOD inputs by the total predictive variance.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import regression_um, reg_test_loader, reg_val_loader
    >>> report = posthoc.evaluate(regression_um, reg_test_loader, ci=0.95)   # wrapped with likelihood="regression"
    >>> report.kind
    'gaussian'
    >>> print(report.to_markdown())
    | method | RMSE | MAE | NLL | CRPS | cov 50% | width 50% | cov 90% | width 90% | cov 95% | width 95% | MACE | ENCE |
    |---|---|---|---|---|---|---|---|---|---|---|---|---|
    | laplace | 0.1619 [0.1477, 0.1760] | 0.1351 [0.1229, 0.1473] | -0.3941 [-0.4943, -0.2851] | ...
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)
    >>> posthoc.evaluate(regression_um, reg_test_loader, conformal=cp).coverage       # about 0.9
    0.87
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.predictions import predict_regression_loader
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap, gaussian_metrics, metrics
from posthoc.evaluation.gaussian_metrics import LEVELS, components, interval_statistics, level_name
from posthoc.evaluation.ood_report import OODValues, scoring_detector
from posthoc.evaluation.table import cell, shared_level
from posthoc.guarantees.conformal import ConformalRegressor


def interval_columns() -> tuple[str, ...]:
    """``coverage_50, width_50, coverage_90, ...``: the interval columns of :data:`LEVELS`, in order."""
    return tuple(f"{what}_{level_name(level)}" for level in LEVELS for what in ("coverage", "width"))


#: the Markdown header of each metric of :attr:`Gaussian.COLUMNS`
COLUMN_HEADERS = {
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

#: bins of predicted std behind ENCE (a test set of fewer points reports it as unavailable)
ENCE_BINS = 10


class Gaussian:
    """A regression predictive's metric set (:mod:`~posthoc.evaluation.gaussian_metrics`), its steps those of
    :class:`~posthoc.evaluation.report.Categorical`: ``coverage_50`` / ``width_50`` (and ``_90``, ``_95``) are those
    of the central interval of that level; ``ence`` is ``None`` for fewer points than :data:`ENCE_BINS`. Given
    conformal intervals: ``coverage`` and ``width`` of those.
    """

    name = "gaussian"
    COLUMNS = ("rmse", "mae", "nll", "crps", *interval_columns(), "mace", "ence")
    #: the Markdown header of each of :attr:`COLUMNS`
    HEADERS = tuple(COLUMN_HEADERS[column] for column in COLUMNS)
    #: present in ``as_dict`` only when the report measured conformal intervals
    GUARANTEE_COLUMNS = ("alpha", "coverage", "width")
    #: collects a regressor's predictions and targets over a loader
    predict = staticmethod(predict_regression_loader)

    @staticmethod
    def values(
        means: Tensor,
        stds: Tensor,
        targets: Tensor,
        *,
        conformal: tuple[Tensor, Tensor] | None = None,
        alpha: float | None = None,
    ) -> dict[str, Any]:
        """Every metric of a predictive ``(means, stds)`` ``(K, N, D)`` on ``targets`` (and of conformal
        ``(lower, upper)`` intervals at ``alpha``, if given), by field name of the report."""
        targets = gaussian_metrics.as_targets(means, targets)
        values = {}
        for level in LEVELS:
            covered, width = gaussian_metrics.interval_coverage(means, stds, targets, level)
            values |= {f"coverage_{level_name(level)}": covered, f"width_{level_name(level)}": width}
        if conformal is not None:
            whole = torch.arange(targets.shape[0])[None]
            stats = interval_statistics(*conformal, targets)
            values |= {"alpha": alpha, **{key: float(stat(whole)[0]) for key, stat in stats.items()}}
        enough = targets.numel() >= ENCE_BINS
        return {
            "rmse": gaussian_metrics.rmse(means, targets),
            "mae": gaussian_metrics.mae(means, targets),
            "nll": gaussian_metrics.nll(means, stds, targets),
            "crps": gaussian_metrics.crps(means, stds, targets),
            **values,
            "mace": gaussian_metrics.calibration_error(means, stds, targets),
            "ence": gaussian_metrics.ence(means, stds, targets, bins=ENCE_BINS) if enough else None,
            "means": means,
            "stds": stds,
            "targets": targets,
        }

    @staticmethod
    def observed(report: Any) -> Tensor:
        return report.targets

    @staticmethod
    def kept(report: Any) -> list[Tensor | None]:
        return [report.means, report.stds]

    @staticmethod
    def example_nll(report: Any) -> Tensor:
        """The per-example NLL ``(N,)`` (joint over outputs; the mean is ``nll``), float64 on the CPU."""
        if report.means is None:
            raise InputError(f"report {report.name!r} keeps no predictions; use reports made by posthoc.evaluate")
        return gaussian_metrics.example_nll(report.means, report.stds, report.targets)

    @staticmethod
    def example_statistics(report: Any) -> dict[str, bootstrap.Statistic]:
        return gaussian_metrics.statistics(report.means, report.stds, report.targets)

    @staticmethod
    def guarantee_columns(reports: Sequence[Any]) -> dict[str, list[str]]:
        if all(r.coverage is None for r in reports):
            return {}
        return {
            f"conformal coverage (alpha{shared_level(reports, 'alpha')})": [
                cell(r.coverage, r.intervals.get("coverage")) for r in reports
            ],
            "conformal width": [cell(r.width, r.intervals.get("width")) for r in reports],
        }

    @staticmethod
    def check_options(um: UncertainModel, conformal: object, selective: object) -> None:
        """Refuse guarantees that do not fit a regressor ``um``: a selective rule, or conformal sets."""
        if selective is not None:
            raise ConfigError("posthoc.selective is for classifiers; evaluate a regressor without selective=")
        if conformal is not None and not isinstance(conformal, ConformalRegressor):
            raise ConfigError(
                "conformal= holds a classifier's conformal sets; calibrate intervals on this regressor: "
                "posthoc.conformal(um, calibration_loader, alpha=...)"
            )

    @staticmethod
    def guarantees(test: RegressionPrediction, conformal: ConformalRegressor | None, selective: None) -> dict[str, Any]:
        """The conformal intervals ``(lower, upper)`` of the test predictions (``bounds``, ``None`` without them), made
        once for the report and its bootstrap."""
        return {"bounds": None if conformal is None else conformal.intervals(test), "conformal": conformal}

    @classmethod
    def measured(
        cls,
        test: RegressionPrediction,
        targets: Tensor,
        checked: dict[str, Any],
        ood_values: OODValues | None,
        ood: RegressionPrediction | None = None,
    ) -> dict[str, Any]:
        """The fields of the report of predictions ``test`` on ``targets``, with the intervals of ``checked``
        (:meth:`guarantees`) and the OOD scores' values (by the total predictive variance first)."""
        conformal = checked["conformal"]
        values = cls.values(
            *components(test),
            targets,
            conformal=checked["bounds"],
            alpha=None if conformal is None else conformal.alpha,
        )
        if ood_values is not None:
            scored = {score: metrics.ood_metrics(*pair) for score, pair in ood_values.items()}
            values |= {"ood_values": ood_values, "ood": scored, "ood_auroc": scored["variance"]["auroc"]}
        return values

    @staticmethod
    def resampled(
        report: Any,
        test: RegressionPrediction,
        ood: RegressionPrediction | None,
        checked: dict[str, Any],
        *,
        ci: float,
        bootstraps: int,
        seed: int,
    ) -> dict[str, tuple[float, float]]:
        stats = Gaussian.example_statistics(report)
        if checked["bounds"] is not None:
            stats |= interval_statistics(*checked["bounds"], report.targets)
        return bootstrap.intervals(stats, len(report.targets), ci=ci, bootstraps=bootstraps, seed=seed)

    @staticmethod
    def score_ood(
        um: UncertainModel,
        test: RegressionPrediction,
        ood: RegressionPrediction,
        test_loader: Iterable,
        ood_loader: Iterable,
        ood_scores: object,
        *,
        progress: bool,
        generator: torch.Generator,
    ) -> OODValues:
        """Per OOD score, its values ``(on the test set, on the OOD set)``: ``um``'s total predictive variance, then the
        detector scores of ``ood_scores`` (names of scores that need no fit, or a fitted ``posthoc.detector``)."""
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
