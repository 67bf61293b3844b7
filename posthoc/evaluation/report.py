"""``posthoc.evaluate``: run a wrapped model over a test loader and summarise it in a :class:`Report`.

Given fitted guarantees (``posthoc.conformal`` / ``posthoc.selective``), the report also measures them on the test
set. Reports of several methods on the same test set compare: ``plain.to_markdown(laplace, auto)`` opens with a
``## Verdict`` (:mod:`posthoc.evaluation.verdict`), then the table with the best entry of each column in bold. A
report holds numbers and Markdown; its pictures and HTML page are ``posthoc_apps.report``'s.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import um, test_loader, ood_loader, model, plain_noisy_report
    >>> from posthoc_apps.demo.examples import noisy_report, calibration_loader, train_loader
    >>> report = posthoc.evaluate(um, test_loader, ood_loader=ood_loader)
    >>> print(report.to_markdown())
    | method | acc | NLL | ECE | adaptive ECE | smECE | Brier | AURC | AUGRC | OOD AUROC (H) | OOD AUROC (MI) |
    |---|---|---|---|---|---|---|---|---|---|---|
    | laplace | 0.8125 | 0.4898 | 0.0531 | 0.0846 | 0.0446 | 0.2659 | 0.0987 | 0.0584 | 0.4374 | – |
    >>> plain = posthoc.evaluate(posthoc.wrap(model, method="none"), test_loader, ood_loader=ood_loader)
    >>> print(plain.to_markdown(report, shifts={"noisy": [plain_noisy_report, noisy_report]}))
    ## Verdict
    <BLANKLINE>
    **Use `laplace`**: picked on the test data, the lowest NLL under shift among the rows within the tolerance; ...
    | none | **0.8125** | 0.5966 | 0.0900 | 0.0994 | 0.0831 | 0.2729 | **0.0969** | **0.0568** | 0.1008 | – |
    | laplace | **0.8125** | **0.4898** | **0.0531** | **0.0846** | **0.0446** | **0.2659** | 0.0987 | 0.0584 | **0.4374** | – |
    ...
    >>> cp = posthoc.conformal(um, calibration_loader, alpha=0.1)
    >>> sel = posthoc.selective(um, calibration_loader, target_risk=0.2)
    >>> checked = posthoc.evaluate(um, test_loader, conformal=cp, selective=sel)
    >>> checked.coverage, checked.deferral, checked.selective_risk     # coverage about 0.9, risk at most 0.2
    (0.88, 0.16, 0.12)
    >>> det = posthoc.detector(um, score=["energy", "knn"]).fit(train_loader)
    >>> print(posthoc.evaluate(um, test_loader, ood_loader, ood_scores=det).ood_to_markdown())
    | method | score | AUROC | AUPR-in | AUPR-out | FPR@95TPR |
    ...
    | laplace | knn | 0.7922 | 0.8697 | 0.6460 | 0.3438 |

One :class:`Report` class serves every kind of prediction: its metric set (:data:`KINDS`) says which metrics it
measures, keeps and shows, and supplies each step of :func:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import integer
from posthoc.core.inputs import as_tensor
from posthoc.core.model_card import choice_line
from posthoc.core.prediction import Prediction
from posthoc.core.rendering import markdown_html
from posthoc.engine.dense import DenseModel
from posthoc.engine.predictions import predict_loader
from posthoc.engine.uncertain_model import UncertainModel, check_wrapped
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap, metrics, ood_report
from posthoc.evaluation.comparison import auto_selection, compared_verdict
from posthoc.evaluation.dense import evaluate_dense
from posthoc.evaluation.duplicates import Merged, merge_identical, merge_note
from posthoc.evaluation.gaussian_report import Gaussian
from posthoc.evaluation.table import BEST_CAPTION, markdown_table, shared_level
from posthoc.evaluation.table import cell as _cell
from posthoc.evaluation.verdict import Verdict
from posthoc.guarantees import measures
from posthoc.guarantees.conformal import ConformalPredictor, ConformalRegressor
from posthoc.guarantees.selective import SelectivePredictor
from posthoc.guarantees.sources import is_regression
from posthoc.methods.calibration.base import Calibrator, held_out_logits
from posthoc.ood.detector import Detector


class Categorical:
    """A classifier's metric set (:mod:`posthoc.evaluation.metrics`), what :class:`Report` measures when
    ``kind == "categorical"``. ``ood_auroc`` ranks by total predictive entropy, ``ood_auroc_mi`` by mutual information
    (``None`` for deterministic predictives). Given conformal sets: ``coverage`` and ``set_size``; given a selective
    rule: ``deferral`` and ``selective_risk`` (the error rate on the accepted examples).
    """

    name = "categorical"
    COLUMNS = (
        "accuracy",
        "nll",
        "ece",
        "adaptive_ece",
        "smooth_ece",
        "brier",
        "aurc",
        "augrc",
        "ood_auroc",
        "ood_auroc_mi",
    )
    #: the Markdown header of each of :attr:`COLUMNS`
    HEADERS = (
        "acc",
        "NLL",
        "ECE",
        "adaptive ECE",
        "smECE",
        "Brier",
        "AURC",
        "AUGRC",
        "OOD AUROC (H)",
        "OOD AUROC (MI)",
    )
    #: present in ``as_dict`` only when the report measured a guarantee
    GUARANTEE_COLUMNS = ("alpha", "coverage", "set_size", "target_risk", "deferral", "selective_risk")
    #: collects a classifier's predictions and labels over a loader
    predict = staticmethod(predict_loader)
    #: per OOD score, its values on the test and OOD sets: the method's entropy / MI, then ``ood_scores``
    score_ood = staticmethod(ood_report.ood_values)

    @staticmethod
    def values(
        probs: Tensor,
        labels: Tensor,
        entropy: Tensor | None = None,
        ood_entropy: Tensor | None = None,
        epistemic: Tensor | None = None,
        ood_epistemic: Tensor | None = None,
        *,
        sets: Tensor | None = None,
        alpha: float | None = None,
        accepted: Tensor | None = None,
        target_risk: float | None = None,
        ood_values: dict[str, tuple[Tensor, Tensor]] | None = None,
    ) -> dict[str, Any]:
        """Every metric from collected probabilities (and OOD scores, conformal ``sets`` at ``alpha``, the
        ``accepted`` mask of a selective rule at ``target_risk``, and per OOD score its ``(test, OOD)`` values, if
        given), by field name of the report."""
        has_ood = entropy is not None and ood_entropy is not None
        has_mi = (
            has_ood
            and epistemic is not None
            and ood_epistemic is not None
            and bool((epistemic > 0).any() or (ood_epistemic > 0).any())
        )
        correct = probs.argmax(-1) == labels
        return {
            "accuracy": metrics.accuracy(probs, labels),
            "nll": metrics.nll(probs, labels),
            "ece": metrics.ece(probs, labels),
            "brier": metrics.brier(probs, labels),
            "aurc": metrics.aurc(probs, labels),
            "adaptive_ece": metrics.adaptive_ece(probs, labels),
            "smooth_ece": metrics.smooth_ece(probs, labels),
            "augrc": metrics.augrc(probs, labels),
            "ood_auroc": metrics.ood_auroc(entropy, ood_entropy) if has_ood else None,
            "ood_auroc_mi": metrics.ood_auroc(epistemic, ood_epistemic) if has_mi else None,
            "alpha": None if sets is None else alpha,
            "coverage": None if sets is None else measures.coverage(sets, labels),
            "set_size": None if sets is None else measures.mean_set_size(sets),
            "target_risk": None if accepted is None else target_risk,
            "deferral": None if accepted is None else measures.deferral_rate(accepted),
            "selective_risk": None if accepted is None else measures.selective_risk(accepted.cpu(), correct),
            "probs": probs,
            "labels": labels,
            "ood": {name: metrics.ood_metrics(*pair) for name, pair in ood_values.items()} if ood_values else None,
            "ood_values": ood_values or None,
        }

    @staticmethod
    def observed(report: Report) -> Tensor:
        """The test labels ``(N,)`` the report scored."""
        return report.labels

    @staticmethod
    def kept(report: Report) -> list[Tensor | None]:
        """The predictions the report keeps (its probabilities): two reports that keep the same predict the same."""
        return [report.probs]

    @staticmethod
    def example_nll(report: Report) -> Tensor:
        """The per-example NLL ``(N,)`` of the kept probabilities (the mean is ``nll``), float64 on the CPU."""
        if report.probs is None or report.labels is None:
            raise InputError(f"report {report.name!r} keeps no probabilities; use reports made by posthoc.evaluate")
        picked = report.probs.double().cpu().gather(-1, report.labels.cpu().long()[:, None]).squeeze(-1)
        return -picked.clamp_min(metrics.EPS).log()

    @staticmethod
    def example_statistics(report: Report) -> dict[str, bootstrap.Statistic]:
        """The classification metrics as bootstrap statistics of an index matrix of resampled examples."""
        return bootstrap.example_statistics(report.probs, report.labels)

    @staticmethod
    def guarantee_columns(reports: Sequence[Report]) -> dict[str, list[str]]:
        """Markdown columns for the guarantees any of ``reports`` measured (header -> one cell per report)."""
        columns = {}
        if any(r.coverage is not None for r in reports):
            alpha = shared_level(reports, "alpha")
            columns[f"coverage (alpha{alpha})"] = [_cell(r.coverage, r.intervals.get("coverage")) for r in reports]
            columns["set size"] = ["–" if r.set_size is None else f"{r.set_size:.2f}" for r in reports]
        if any(r.deferral is not None for r in reports):
            risk = shared_level(reports, "target_risk")
            columns[f"deferral (target risk{risk})"] = [_cell(r.deferral) for r in reports]
            columns["accepted error"] = [_cell(r.selective_risk, r.intervals.get("selective_risk")) for r in reports]
        return columns

    @staticmethod
    def check_options(
        um: UncertainModel, conformal: ConformalPredictor | None, selective: SelectivePredictor | None
    ) -> None:
        """A classifier takes conformal sets and a selective rule: nothing to refuse beyond :func:`evaluate`'s
        checks."""

    @staticmethod
    def guarantees(
        test: Prediction, conformal: ConformalPredictor | None, selective: SelectivePredictor | None
    ) -> dict[str, Any]:
        """The conformal ``sets`` and the selective rule's ``accepted`` mask on the test predictions (``None`` where
        not given), made once for the report and its bootstrap."""
        return {
            "sets": None if conformal is None else conformal.sets(test).cpu(),
            "accepted": None if selective is None else selective.accept(test).cpu(),
            "alpha": None if conformal is None else conformal.alpha,
            "target_risk": None if selective is None else selective.target_risk,
        }

    @classmethod
    def measured(
        cls,
        test: Prediction,
        labels: Tensor,
        checked: dict[str, Any],
        ood_values: dict[str, tuple[Tensor, Tensor]] | None,
        ood: Prediction | None = None,
    ) -> dict[str, Any]:
        """The fields of the report of predictions ``test`` (and ``ood``) on ``labels``, with the guarantees of
        ``checked`` (:meth:`guarantees`) and the OOD scores' values."""
        return cls.values(
            test.probs,
            labels,
            test.entropy,
            None if ood is None else ood.entropy,
            test.epistemic,
            None if ood is None else ood.epistemic,
            ood_values=ood_values,
            **checked,
        )

    @staticmethod
    def resampled(
        report: Report,
        test: Prediction,
        ood: Prediction | None,
        checked: dict[str, Any],
        *,
        ci: float,
        bootstraps: int,
        seed: int,
    ) -> dict[str, tuple[float, float]]:
        """Bootstrap intervals at level ``ci`` of every metric, of the guarantees in ``checked`` and of each OOD
        AUROC (both sets resampled)."""
        ood_pairs = {} if ood is None else {"ood_auroc": (test.entropy, ood.entropy)}
        if ood is not None and report.ood_auroc_mi is not None:
            ood_pairs["ood_auroc_mi"] = (test.epistemic, ood.epistemic)
        ood_pairs |= {
            ood_report.interval_key(name): pair
            for name, pair in (report.ood_values or {}).items()
            if name not in ood_report.OWN_SCORES
        }
        return bootstrap.report_intervals(
            test.probs,
            report.labels,
            ci=ci,
            bootstraps=bootstraps,
            seed=seed,
            ood=ood_pairs,
            sets=checked["sets"],
            accepted=checked["accepted"],
        )


#: the metric set of each kind of prediction: what a report measures, keeps and shows
KINDS = {kind.name: kind for kind in (Categorical, Gaussian)}
#: a metric set (:class:`Categorical` or :class:`~posthoc.evaluation.gaussian_report.Gaussian`)
MetricSet = type[Categorical] | type[Gaussian]


@dataclass(repr=False)
class Report:
    """Metrics of one predictive on one test set (and optionally an OOD set), those of its ``kind``'s metric set
    (:data:`KINDS`); the fields of the other kind stay ``None``.

    With ``ci=``, ``intervals`` maps each metric to its bootstrap interval (AUROCs of OOD scores under
    ``ood_auroc:NAME``). ``ood`` maps each OOD score to its ``auroc``, ``aupr_in``, ``aupr_out`` and ``fpr95``.
    ``selection`` (auto's selection record), ``predict_cost`` and ``forward_seconds``
    (:func:`posthoc.evaluation.comparison.predict_timing`) are read by the verdict.
    """

    name: str
    kind: str = Categorical.name
    nll: float | None = None
    # a classifier's (Categorical)
    accuracy: float | None = None
    ece: float | None = None
    brier: float | None = None
    aurc: float | None = None
    adaptive_ece: float | None = None
    smooth_ece: float | None = None
    augrc: float | None = None
    ood_auroc_mi: float | None = None
    set_size: float | None = None
    target_risk: float | None = None
    deferral: float | None = None
    selective_risk: float | None = None
    probs: Tensor | None = None
    labels: Tensor | None = None
    # a regressor's (Gaussian)
    rmse: float | None = None
    mae: float | None = None
    crps: float | None = None
    coverage_50: float | None = None
    width_50: float | None = None
    coverage_90: float | None = None
    width_90: float | None = None
    coverage_95: float | None = None
    width_95: float | None = None
    mace: float | None = None
    ence: float | None = None
    width: float | None = None
    means: Tensor | None = None
    stds: Tensor | None = None
    targets: Tensor | None = None
    # both
    ood_auroc: float | None = None
    alpha: float | None = None
    coverage: float | None = None
    ci: float | None = None
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    ood: dict[str, dict[str, float]] | None = None
    #: per OOD score, its values (on the test set, on the OOD set), for the OOD histograms
    ood_values: dict[str, tuple[Tensor, Tensor]] | None = None
    selection: dict[str, Any] | None = None
    predict_cost: float | None = None
    forward_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"a report's kind is one of {', '.join(KINDS)}, got {self.kind!r}")

    def __repr__(self) -> str:
        return (
            f"Report(name={self.name!r}, kind={self.kind!r}, "
            + ", ".join(f"{k}={v!r}" for k, v in self._measured().items())
            + ")"
        )

    def _measured(self) -> dict[str, Any]:
        """The metrics of the kind's set by name, then the guarantees it measured."""
        kind = self.metric_set
        found = {c: getattr(self, c) for c in kind.COLUMNS}
        return found | {c: getattr(self, c) for c in kind.GUARANTEE_COLUMNS if getattr(self, c) is not None}

    @classmethod
    def from_predictions(cls, name: str, probs: Tensor, labels: Tensor, *args: Tensor | None, **kwargs: Any) -> Report:
        """A classifier's report from collected probabilities (the arguments of :meth:`Categorical.values`)."""
        return cls(name=name, kind=Categorical.name, **Categorical.values(probs, labels, *args, **kwargs))

    @classmethod
    def from_gaussian(
        cls,
        name: str,
        means: Tensor,
        stds: Tensor,
        targets: Tensor,
        *,
        conformal: tuple[Tensor, Tensor] | None = None,
        alpha: float | None = None,
    ) -> Report:
        """A regressor's report of a Gaussian mixture ``(means, stds)`` ``(K, N, D)`` on ``targets`` (and of
        conformal ``(lower, upper)`` intervals at ``alpha``, if given).

        Example:
            >>> import torch
            >>> from posthoc.evaluation.report import Report
            >>> Report.from_gaussian("MAP", torch.zeros(1, 4, 1), torch.ones(1, 4, 1), torch.zeros(4)).rmse
            0.0
        """
        values = Gaussian.values(means, stds, targets, conformal=conformal, alpha=alpha)
        return cls(name=name, kind=Gaussian.name, **values)

    @property
    def metric_set(self) -> MetricSet:
        """The metric set of this report's kind (:data:`KINDS`)."""
        return KINDS[self.kind]

    def as_dict(self) -> dict[str, Any]:
        """The metrics by name; the guarantee columns only where measured."""
        bounds = {"ci": self.ci, "intervals": {k: list(v) for k, v in self.intervals.items()}} if self.intervals else {}
        ood = {"ood_auroc": self.ood_auroc, "ood": self.ood} if self.ood else {}
        return {**self._measured(), **bounds, **ood}

    @property
    def observed(self) -> Tensor:
        """The test labels ``(N,)`` or targets ``(N, D)`` the report scored."""
        return self.metric_set.observed(self)

    def example_nll(self) -> Tensor:
        """The per-example NLL ``(N,)`` of the kept predictions (the mean is :attr:`nll`), float64 on the CPU."""
        return self.metric_set.example_nll(self)

    def example_statistics(self) -> dict[str, bootstrap.Statistic]:
        """The metrics of :attr:`COLUMNS` as bootstrap statistics of an index matrix of resampled examples."""
        return self.metric_set.example_statistics(self)

    def to_markdown(self, *others: Report, shifts: Mapping[str, Sequence[Report]] | None = None) -> str:
        """A one-row Markdown table of the metrics; given ``others`` (other methods on the same test set), this report
        is the plain model they are judged against: ``## Verdict`` first, then one table of every report
        (:class:`Compared`). ``shifts`` maps a shifted test set's name to its reports, in the order ``[self, *others]``.
        """
        if not others:
            return markdown_table([self])
        compared = Compared.of([self, *others], shifts)
        return compared.verdict.markdown() + "\n" + compared.table()

    def ood_to_markdown(self) -> str:
        """The OOD table: AUROC, AUPR-in, AUPR-out and FPR at 95% TPR of every OOD score ("" without an OOD set)."""
        if not self.ood:
            return ""
        bounds = {
            name: self.intervals[ood_report.interval_key(name)]
            for name in self.ood
            if ood_report.interval_key(name) in self.intervals
        }
        return ood_report.ood_markdown({self.name: self.ood}, {self.name: bounds})

    def _repr_markdown_(self) -> str:
        """Jupyter's view: the metrics table (and the OOD table), under the line naming what ``"auto"`` chose against
        the plain baseline; the pictures are drawn by ``posthoc_apps.report``."""
        chosen = choice_line(self.selection) if self.selection else ""
        return "\n\n".join(filter(None, [chosen, self.to_markdown(), self.ood_to_markdown()]))

    def _repr_html_(self) -> str:
        """Jupyter's view as HTML: :meth:`_repr_markdown_`'s tables as tables.

        Example:
            >>> from posthoc_apps.demo.examples import report
            >>> report._repr_html_().startswith("<table><thead><tr><th>method</th>")
            True
        """
        return markdown_html(self._repr_markdown_())


@dataclass
class Compared:
    """Reports of several methods on one test set, the first the plain model, after rows that predict the same are
    merged (:mod:`posthoc.evaluation.duplicates`): the ``reports`` kept, their ``shifts``, the ``merged`` rows and the
    ``verdict`` on the kept ones."""

    reports: list[Report]
    shifts: dict[str, list[Report]]
    merged: list[Merged]
    verdict: Verdict

    @classmethod
    def of(cls, reports: Sequence[Report], shifts: Mapping[str, Sequence[Report]] | None = None) -> Compared:
        """Merge ``reports`` that predict the same (the first, and auto's, are never merged away) and judge the rest.

        Example:
            >>> from posthoc.evaluation.report import Compared
            >>> from posthoc_apps.demo.examples import report, plain_report
            >>> from dataclasses import replace
            >>> again = replace(report, name="laplace again")           # the same predictions under another name
            >>> Compared.of([plain_report, report, again]).merged
            [Merged(label='laplace again', into='laplace', why='the same predictions')]
        """
        shifts = {name: list(found) for name, found in (shifts or {}).items()}
        for name, found in shifts.items():
            if len(found) != len(reports):
                raise ConfigError(
                    f"shift {name!r} has {len(found)} reports for {len(reports)} methods: give one per "
                    "report, in the same order"
                )

        def predictions(i: int, report: Report) -> list[Tensor | None]:
            ood = report.ood_values or {}
            return [
                *report.metric_set.kept(report),
                *(value for name in sorted(shifts) for value in report.metric_set.kept(shifts[name][i])),
                *(value for name in sorted(ood) for value in ood[name]),
            ]

        names = [report.name for report in reports]
        merged = []
        if len(set(names)) == len(names):  # judge refuses repeated names with its own message
            keep = [names[0], *(report.name for report in reports if report.selection)]
            merged = merge_identical({r.name: predictions(i, r) for i, r in enumerate(reports)}, keep=keep)
        gone = {m.label for m in merged}
        index = [i for i, name in enumerate(names) if name not in gone]
        kept = [reports[i] for i in index]
        kept_shifts = {name: [found[i] for i in index] for name, found in shifts.items()}
        return cls(kept, kept_shifts, merged, compared_verdict(kept, kept_shifts))

    def table(self) -> str:
        """The table of the kept reports (the best entries in bold), its caption and the note of merged rows."""
        note = merge_note(self.merged)
        return markdown_table(self.reports) + "\n\n" + BEST_CAPTION + (f"\n\n{note}" if note else "")


def operating_points(*reports: Report) -> dict[str, tuple[float, float]]:
    """``name -> (coverage, error on accepted)`` of the reports that measured a selective rule accepting something."""
    return {
        r.name: (1 - r.deferral, r.selective_risk)
        for r in reports
        if r.deferral is not None and r.selective_risk is not None
    }


def _check_calibrated_on(
    um: UncertainModel, guarantee: ConformalPredictor | SelectivePredictor | None, what: str
) -> None:
    if guarantee is not None and guarantee.model is not None and guarantee.model is not um:
        raise ConfigError(
            f"the {what} guarantee was calibrated on another wrapped model; calibrate it on this one: "
            f"posthoc.{what}(um, calibration_loader, ...)"
        )


def evaluate(
    um: UncertainModel,
    test_loader: Iterable,
    ood_loader: Iterable | None = None,
    *,
    name: str | None = None,
    progress: bool = True,
    num_samples: int | None = None,
    seed: int = 0,
    conformal: ConformalPredictor | ConformalRegressor | None = None,
    selective: SelectivePredictor | None = None,
    ood_scores: Sequence[str] | Detector | None = None,
    ci: float | None = None,
    bootstraps: int = 1000,
) -> Report:
    """Evaluate ``um`` on a labelled test loader, and on an OOD loader (labels ignored) if given.

    From logits alone, ``um`` is a fitted calibrator (``posthoc.calibrate``) and the next two arguments are the test
    logits and labels: ``posthoc.evaluate(calibrator, test_logits, test_labels)`` gives the same :class:`Report` as a
    wrapped model's, and ``posthoc.evaluate(posthoc.calibrate(val_logits, val_labels, method="none"), ...)`` the
    plain baseline's, so that ``plain.to_markdown(report)`` writes the verdict and ``posthoc_apps.report.write_html``
    the page (``ci=`` works as for a model; the other options need the model).

    Args:
        conformal, selective: fitted guarantees (not ``alpha=`` / ``target_risk=``, so that their options stay in one
            place and one calibration serves several test sets), measured on the test set.
        ood_scores: with ``ood_loader``, post-hoc OOD scores reported next to the method's own: names of scores that
            need no fit (``["energy", "max-logit"]``) or a fitted ``posthoc.detector(...)``.
        ci: a confidence level (e.g. 0.95): every metric gets a percentile bootstrap interval over the test
            examples (``bootstraps`` resamples, seeded by ``seed``), in ``report.intervals``.

    A regressor (``likelihood="regression"``) gets a report of kind ``"gaussian"``; ``selective`` is for classifiers.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import um, test_loader
        >>> report = posthoc.evaluate(um, test_loader)
        >>> 0 <= report.ece <= 1
        True
    """
    if isinstance(um, DenseModel):  # per-position metrics (posthoc.evaluation.dense)
        return evaluate_dense({name or "+".join(um.methods): um}, test_loader)
    if isinstance(um, Calibrator):
        if any(value is not None for value in (conformal, selective, ood_scores)) or num_samples is not None:
            raise ConfigError(
                "from logits, evaluate(calibrator, test_logits, test_labels) measures the calibrated probabilities "
                "only; conformal=, selective=, ood_scores= and num_samples= need the wrapped model"
            )
        return evaluate_logits(um, test_loader, ood_loader, name=name, ci=ci, bootstraps=bootstraps, seed=seed)
    check_wrapped(um, "evaluate")
    integer(seed, "seed")
    kind = report_type(um)
    kind.check_options(um, conformal, selective)
    _check_calibrated_on(um, conformal, "conformal")
    _check_calibrated_on(um, selective, "selective")
    if ood_scores is not None and ood_loader is None:
        raise ConfigError("ood_scores are measured against an OOD set: pass ood_loader=... as well")
    if ci is not None:
        bootstrap.check_level(ci, bootstraps)
    generator = torch.Generator(device=um.device).manual_seed(seed)
    test, targets = kind.predict(um, test_loader, progress=progress, num_samples=num_samples, generator=generator)
    ood = None
    if ood_loader is not None:
        ood, _ = kind.predict(
            um, ood_loader, labelled=False, progress=progress, num_samples=num_samples, generator=generator, desc="OOD"
        )
    checked = kind.guarantees(test, conformal, selective)
    scores = (
        None
        if ood is None
        else kind.score_ood(um, test, ood, test_loader, ood_loader, ood_scores, progress=progress, generator=generator)
    )
    report = Report(name or "+".join(um.methods), kind.name, **kind.measured(test, targets, checked, scores, ood))
    report.selection = auto_selection(um)
    if ci is not None:
        report.ci = ci
        report.intervals = kind.resampled(report, test, ood, checked, ci=ci, bootstraps=bootstraps, seed=seed)
    return report


def evaluate_logits(
    calibrator: Calibrator,
    logits: Any,
    labels: Any,
    *,
    name: str | None = None,
    ci: float | None = None,
    bootstraps: int = 1000,
    seed: int = 0,
) -> Report:
    """The :class:`Report` of a fitted calibrator's probabilities on test ``logits`` and ``labels`` (what
    ``posthoc.evaluate(calibrator, logits, labels)`` returns), named ``name`` or the calibrator's ``chosen_name``.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import val_logits, val_labels, test_logits, test_labels
        >>> plain = posthoc.evaluate(posthoc.calibrate(val_logits, val_labels, method="none"), test_logits, test_labels)
        >>> tempered = posthoc.evaluate(posthoc.calibrate(val_logits, val_labels), test_logits, test_labels)
        >>> plain.name, tempered.name, plain.to_markdown(tempered).splitlines()[0]
        ('none', 'temperature', '## Verdict')
    """
    if logits is None or labels is None:
        raise InputError("evaluate(calibrator, test_logits, test_labels) needs the test logits and their labels")
    if ci is not None:
        bootstrap.check_level(ci, bootstraps)
    integer(seed, "seed")
    test = calibrator.predict(logits)
    _, targets = held_out_logits(as_tensor(logits, "logits"), labels, samples=False)
    kind = KINDS[Categorical.name]
    checked = kind.guarantees(test, None, None)
    report = Report(name or calibrator.chosen_name, kind.name, **kind.measured(test, targets, checked, None))
    if ci is not None:
        report.ci = ci
        report.intervals = kind.resampled(report, test, None, checked, ci=ci, bootstraps=bootstraps, seed=seed)
    return report


def report_type(um: UncertainModel) -> MetricSet:
    """The metric set of ``um``'s predictions: :class:`~posthoc.evaluation.gaussian_report.Gaussian` for a regressor,
    :class:`Categorical` otherwise.

    Example:
        >>> from posthoc.evaluation.report import report_type
        >>> import torch, posthoc
        >>> report_type(posthoc.wrap(torch.nn.Linear(2, 1), method="none", likelihood="regression")).name
        'gaussian'
    """
    return KINDS[Gaussian.name] if is_regression(um) else KINDS[Categorical.name]
