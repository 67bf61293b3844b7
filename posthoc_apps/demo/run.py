"""``posthoc demo``: the registered methods retrofitted onto the bundled digits checkpoint, in about two minutes;
``--task regression``: the methods that do regression on a trained MLP, on the seed 004 sinusoid and Auto MPG.

The bundled CNN (``posthoc_apps.demo.zoo``) is wrapped by the demo configurations (:func:`demo_configs`; by default the
rows that fit about two minutes on 2 CPU cores, ``every_row`` adds the slower ones and, for each method, a row with
temperature scaling fitted on top of the fitted method); every row is fitted on the fit split, calibrated on the
calibration split, and evaluated on the test digits (with 95% bootstrap intervals), on the test digits corrupted by
``posthoc.evaluate_shift`` (:data:`SHIFT_KINDS` at :data:`SEVERITIES`; rotation by 15, 45 and 90 degrees among them)
and on the held-out digits 8 and 9 as OOD, where every post-hoc score of ``posthoc.detector`` (fitted once on the
plain model) stands next to each method's entropy and mutual information. Rows that predict the same as another are
merged into it (:func:`merged_rows`), and the page names them and the rows left out. Times are ratios to a plain
forward pass over the same data. Writes ``report.md``, the same as one self-contained ``report.html``, and the PNGs;
its progress is one bar with an ETA on a terminal, one line per step in a log (:mod:`posthoc_apps.demo.steps`).

The report opens with the verdict (:mod:`posthoc.evaluation.verdict`): what ``method="auto"`` picked on held-out
data, what it costs in distribution and at predict time and what it buys under the evaluation shifts and on the
held-out digits, in three lines; its numbers with paired bootstrap intervals in a small table beside the frontier
(``frontier.png``: the in-distribution NLL excess against the NLL under shift of the plain model, the pick and the
best rows). Auto's own record of its candidates on held-out data follows the main table
(``selection_frontier.png``).

The shift story at a glance: the plain model against the best configuration (the row with the lowest NLL,
mean over the kinds, at the top severity, or the one named by ``best=``), as mean confidence and accuracy
against severity 0..5 (``confidence.png``: the shaded gap is the overconfidence) and as reliability
diagrams of the digits rotated by 45 degrees side by side (``reliability_rotated45_best.png``).

``posthoc demo --task regression`` (:func:`run_regression_demo`) wraps a trained MLP by every method that does
regression (:data:`REGRESSION_CONFIGS`), in three parts:

1. **The sinusoid** (:func:`~posthoc_apps.demo.data.sinusoid`): an MLP trained on 40 points in two
   clusters, wrapped by each method; the mean predictive std on the training points, in the gap between
   the clusters and beyond the data, and the band plot (``regression_band.png``).
2. **Auto MPG, extrapolating to heavier cars** (:func:`~posthoc_apps.demo.data.auto_mpg`): trained and
   validated on the lighter 70 %, tested on the heavier 30 %; NLL, RMSE, CRPS, 90 % coverage and width,
   MACE and ENCE per method, the calibration curves (``regression_calibration.png``) and the error
   against the predicted std (``regression_error_std.png``).
3. **Auto MPG under shift** (``split="shift"``): one model per method fitted on the lighter cars outside a band
   of middle weights, scored by ``posthoc.evaluate_shift`` on random held-out cars, the heavier 30 % and
   the band (``regression_shift.png``).

Example:
    >>> rows = run_demo(out_dir="posthoc-demo", progress=False)  # the whole demo (minutes)  # doctest: +SKIP
    >>> rows[0].story.plain, rows[0].story.best  # doctest: +SKIP
    ('MAP', 'Laplace (last layer, KFAC)')
    >>> rows[0].verdict.recommended  # doctest: +SKIP
    'auto'
    >>> markdown = run_regression_demo("posthoc-demo")  # the regression demo (minutes)  # doctest: +SKIP
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from posthoc.api import wrap, wrap_spec
from posthoc.core.registry import method_class
from posthoc.engine.choice import make_choice
from posthoc.engine.held_out import HeldOut
from posthoc.engine.predictions import collect
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError
from posthoc.evaluation import bootstrap, gaussian_metrics, metrics, ood_report
from posthoc.evaluation.comparison import candidate
from posthoc.evaluation.duplicates import Merged, merge_identical, merge_note, without
from posthoc.evaluation.report import Report, evaluate, markdown_table
from posthoc.evaluation.shift import ShiftTable, evaluate_shift
from posthoc.evaluation.table import BEST_CAPTION, markdown_rows
from posthoc.evaluation.verdict import Verdict, cost_cell, judge
from posthoc.ood.detector import detector
from posthoc.shift.kinds import EVALUATION_KINDS
from posthoc.shift.kinds import SEVERITIES as PARAMETERS
from posthoc_apps.demo import data, zoo
from posthoc_apps.demo.configs import DEMO_CONFIGS, EXPECTED_SECONDS, LEFT_OUT, TEMPERATURE_SECONDS
from posthoc_apps.demo.steps import Steps
from posthoc_apps.report import figures, page, plots
from posthoc_apps.report.ood_plots import ood_histograms
from posthoc_apps.report.sections import selection_section, verdict_section

SHIFT_KINDS = EVALUATION_KINDS
SEVERITIES = (1, 3, 5)
#: the severities of the confidence plot (the plain model and the best configuration only)
STORY_SEVERITIES = (1, 2, 3, 4, 5)
#: the severity whose rotation (45 degrees) the side-by-side reliability diagram shows
ROTATED45 = 3
#: confidence level of the intervals, and resamples for the test table and for the (many) shift cells
CI, BOOTSTRAPS, SHIFT_BOOTSTRAPS = 0.95, 1000, 200
#: OOD scores read from each method's own predictive (no fit), beside its entropy and mutual information
PREDICTIVE_OOD_SCORES = ("msp", "gen")
#: test digits corrupted per kind and severity (the first of the shuffled test split: 62-63 per class), so that the
#: many shift cells cost about as much as a few passes over the whole test split
SHIFT_EXAMPLES = 500
#: methods whose first row gets no ``+ temperature`` row: the plain model, and auto (whose candidates include it)
NO_TEMPERATURE_ROW = ("none", "auto")
#: the first and the last of the demo's steps (the rows' steps are their labels)
DATA_STEP, REPORT_STEP = "digits, checkpoint and OOD scores", "verdict, plots and report"


@dataclass
class ShiftStory:
    """The plain model against the best configuration under shift: their :class:`ShiftTable` at every severity
    (``STORY_SEVERITIES``) and why ``best`` was picked."""

    plain: str
    best: str
    table: ShiftTable
    chosen_by: str

    @property
    def labels(self) -> list[str]:
        """The plain label, then the best (once, when they are the same row)."""
        return list(dict.fromkeys((self.plain, self.best)))

    def markdown(self) -> str:
        """Mean confidence / accuracy per severity for both, and the two pictures."""
        header = ["method", "clean", *(f"severity {s}" for s in self.table.severities)]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for label in self.labels:
            _, confidence, accuracy = self.table.confidence_series(label)
            lines.append(
                f"| {label} | " + " | ".join(f"{c:.3f} / {a:.3f}" for c, a in zip(confidence, accuracy)) + " |"
            )
        return (
            f"### Does it know when it does not know? {self.plain} against {self.best}\n\n"
            f"{self.best}: {self.chosen_by}. Mean confidence / accuracy, means over {', '.join(self.table.kinds)} "
            f"(the gap is the overconfidence):\n\n"
            + "\n".join(lines)
            + "\n\n![mean confidence and accuracy against severity](confidence.png)\n\n"
            "![reliability on the digits rotated by 45 degrees, plain against best](reliability_rotated45_best.png)\n"
        )


@dataclass
class DemoRow:
    """One fitted configuration: its report on the test digits, its shift table and costs."""

    label: str
    report: Report
    shift: ShiftTable
    fit_ratio: float
    predict_ratio: float
    #: every post-hoc OOD score of the plain model (shared by all rows), see :func:`post_hoc_ood`
    post_hoc_ood: ood_report.OODValues | None = None
    #: the plain model against the best configuration under shift (shared by all rows), see :func:`shift_story`
    story: ShiftStory | None = None
    #: which row to use and its numbers (shared by all rows), see :func:`demo_verdict`
    verdict: Verdict | None = None
    #: the rows merged into others because they predict the same (shared by all rows), see :func:`merged_rows`
    merged: list[Merged] | None = None
    #: the demo configurations not run (shared by all rows), see :func:`left_out`
    left_out: list[str] | None = None
    #: the plain forward's seconds over the test digits, against which ``predict_ratio`` is measured
    forward_seconds: float | None = None


def _split_options(name: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    fit_names = method_class(name).fit_option_defaults()
    return (
        {k: v for k, v in options.items() if k not in fit_names},
        {k: v for k, v in options.items() if k in fit_names},
    )


def _timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def demo_configs(
    only: list[str] | None = None, *, every_row: bool = True
) -> list[tuple[str, list[dict[str, Any]], dict[str, Any], bool]]:
    """``(label, spec, fit_options, add_temperature)`` for the demo rows of :data:`~posthoc_apps.demo.configs.DEMO_CONFIGS`
    (of the methods ``only`` when given).

    With ``every_row``, the first row of each method (other than MAP and temperature) also gets a ``+ temperature``
    row, fitted on top of the already fitted method; without it (what ``posthoc demo`` runs unless told ``--all``,
    so that it fits in about two minutes) those rows and the rows of :data:`~posthoc_apps.demo.configs.LEFT_OUT` are left
    out, except for the methods ``only`` names. A stacking method's row stacks on the methods its option ``"on"``
    names, else on the plain model.

    Example:
        >>> from posthoc_apps.demo.run import demo_configs
        >>> [label for label, *_ in demo_configs(["none", "temperature"])]
        ['MAP', 'temperature']
        >>> "LLLA full" in [label for label, *_ in demo_configs(every_row=False)]
        False
    """
    configs = []
    for name, rows in DEMO_CONFIGS.items():
        if only and name not in only:
            continue
        cls = method_class(name)
        for position, (label, options) in enumerate(rows):
            if not (every_row or only) and label in LEFT_OUT:
                continue
            options = dict(options)
            inner = [{"name": base, "options": {}} for base in options.pop("on", [])]
            wrap_options, fit_options = _split_options(name, options)
            stack = (every_row or bool(only)) and position == 0 and not cls.stacks and name not in NO_TEMPERATURE_ROW
            configs.append((label, [*inner, {"name": name, "options": wrap_options}], fit_options, stack))
    return configs


def left_out(only: list[str] | None = None, *, every_row: bool = True) -> list[str]:
    """The demo rows :func:`demo_configs` leaves out with these arguments, in words (the page names them).

    Example:
        >>> from posthoc_apps.demo.run import left_out
        >>> left_out(every_row=False)[-1]
        'a `+ temperature` row per method'
    """
    run = {label for label, *_ in demo_configs(only, every_row=every_row)}
    every = demo_configs(only, every_row=True)
    rows = [label for label, *_ in every if label not in run]
    stacked = any(stack for *_, stack in every) and not any(
        stack for *_, stack in demo_configs(only, every_row=every_row)
    )
    return rows + (["a `+ temperature` row per method"] if stacked else [])


def _plain_forward_seconds(model: torch.nn.Module, loader) -> float:
    with torch.no_grad():
        _, seconds = _timed(lambda: [model(x) for x, _ in loader])
    return seconds


def _with_temperature(um: UncertainModel, cal_loader) -> tuple[UncertainModel, float]:
    """Temperature stacked on an already fitted ``um`` and chosen by the selection step on ``cal_loader``, as ``fit``
    would choose it; the inner method is neither refitted nor chosen again."""
    top = method_class("temperature").build(um.method)
    stacked = UncertainModel(top, [*um.spec, {"name": "temperature", "options": {}}], fingerprint=um.fingerprint)

    def choose() -> None:
        model, likelihood = um.method.plain_model, stacked.likelihood
        make_choice(top, HeldOut.read(cal_loader, model=model, likelihood=likelihood, device=stacked.device))
        top.fitted.fill_(True)

    _, seconds = _timed(choose)
    return stacked, seconds


#: the post-hoc OOD scores the demo reports: those of the logits and softmax, and three of the features (every score
#: is measured on these digits in docs/ood-shift.md)
DEMO_OOD_SCORES = ("msp", "max-logit", "energy", "entropy", "gen", "mahalanobis", "vim", "knn")


def post_hoc_ood(model: torch.nn.Module, fit_loader, test_loader, ood_loader) -> ood_report.OODValues:
    """The OOD scores :data:`DEMO_OOD_SCORES` of ``posthoc.detector`` on the plain model (fitted once on the fit
    split), as ``score -> (values on the test digits, values on the held-out digits)``."""
    names = list(DEMO_OOD_SCORES)
    scorer = detector(model, score=names).fit(fit_loader, progress=False)
    on_test, on_ood = (scorer.score_loader(loader, progress=False) for loader in (test_loader, ood_loader))
    return {name: (on_test[name], on_ood[name]) for name in names}


def shift_story(
    rows: list[DemoRow],
    models: dict[str, UncertainModel],
    plain: str,
    shift_loader,
    *,
    best: str | None = None,
    seed: int = 0,
    progress: bool = False,
) -> ShiftStory:
    """The plain row against ``best`` (default: the other row with the lowest NLL, mean over the kinds, at the
    top severity) at every severity of ``STORY_SEVERITIES``: the rows' own shift tables, and the severities
    they lack evaluated for these two only."""
    merged = ShiftTable.merge([row.shift for row in rows])
    if best is None:
        best = merged.best_method(exclude=[plain])
        chosen_by = f"the lowest NLL, mean over the kinds, at severity {max(merged.severities)} of the rows here"
    elif best not in models:
        raise ConfigError(f"no demo row {best!r} to compare with; rows: {', '.join(models)}")
    else:
        chosen_by = "named"
    labels = list(dict.fromkeys((plain, best)))
    measured = ShiftTable.merge([row.shift for row in rows if row.label in labels])
    missing = [s for s in STORY_SEVERITIES if s not in measured.severities]
    if missing:  # only the severities the rows lack are evaluated again
        extra = evaluate_shift(
            {label: models[label] for label in labels},
            shift_loader,
            kinds=SHIFT_KINDS,
            severities=missing,
            normalization=(data.MEAN, data.STD),
            seed=seed,
            progress=progress,
        )
        measured = ShiftTable.join([measured, extra])
    return ShiftStory(plain, best, measured, chosen_by)


def run_demo(
    out_dir: str | Path = "posthoc-demo",
    *,
    methods: list[str] | None = None,
    progress: bool = True,
    seed: int = 0,
    best: str | None = None,
    every_row: bool = False,
    stream: IO[str] | None = None,
) -> list[DemoRow]:
    """Fit and evaluate the demo configurations; write PNGs, ``report.md`` and ``report.html`` to ``out_dir``.

    ``methods``: only these methods' rows (every row of each); otherwise the rows that fit in about two minutes on
    2 CPU cores, or with ``every_row`` all of them (:func:`demo_configs`; the page names what was left out). Rows
    that predict the same as an earlier row are merged into it (:mod:`posthoc.evaluation.duplicates`). ``best``
    names the row the shift story compares with the plain model (default: the row with the lowest NLL under the
    strongest shift). ``progress``: one bar with an ETA on a terminal, one line per step elsewhere, to ``stream``
    (:class:`posthoc_apps.demo.steps.Steps`).
    """
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = demo_configs(methods, every_row=every_row)
    weights = {DATA_STEP: EXPECTED_SECONDS[DATA_STEP]}
    for label, _, _, add_temperature in configs:
        weights[label] = EXPECTED_SECONDS.get(label, EXPECTED_SECONDS[None])
        if add_temperature:
            weights[f"{label} + temperature"] = TEMPERATURE_SECONDS
    weights[REPORT_STEP] = EXPECTED_SECONDS[REPORT_STEP]
    steps = Steps(weights, enabled=progress, stream=stream)
    with steps.step(DATA_STEP):
        splits = data.load_digits()
        model = zoo.pretrained()
        fit_loader = data.loader(splits.fit, batch_size=256)
        cal_loader = data.loader(splits.calibration, batch_size=256)
        test_loader = data.loader(splits.test, batch_size=500)
        shift_loader = data.loader(data.subset(splits.test, SHIFT_EXAMPLES), batch_size=500)
        ood_loader = data.loader(splits.ood, batch_size=500)
        forward_fit = _plain_forward_seconds(model, fit_loader)
        forward_test = min(_plain_forward_seconds(model, test_loader) for _ in range(3))
        ood = post_hoc_ood(model, fit_loader, test_loader, ood_loader)

    def row(label: str, um: UncertainModel, fit_seconds: float) -> DemoRow:
        predict_seconds = min(
            _timed(lambda: collect(um, test_loader, progress=False, generator=torch.Generator().manual_seed(seed)))[1]
            for _ in range(2)
        )
        report = evaluate(
            um,
            test_loader,
            ood_loader,
            name=label,
            progress=False,
            seed=seed,
            ci=CI,
            bootstraps=BOOTSTRAPS,
            ood_scores=PREDICTIVE_OOD_SCORES,
        )
        shift = evaluate_shift(
            {label: um},
            shift_loader,
            kinds=SHIFT_KINDS,
            severities=SEVERITIES,
            normalization=(data.MEAN, data.STD),
            seed=seed,
            ci=CI,
            bootstraps=SHIFT_BOOTSTRAPS,
            progress=False,
        )
        return DemoRow(
            label,
            report,
            shift,
            fit_seconds / forward_fit,
            predict_seconds / forward_test,
            ood,
            forward_seconds=forward_test,
        )

    rows, models, plain = [], {}, None
    for label, spec, fit_options, add_temperature in configs:
        with steps.step(label):
            torch.manual_seed(seed)
            um: UncertainModel = wrap_spec(model, spec)
            _, fit_seconds = _timed(lambda: um.fit(fit_loader, cal_loader, progress=False, **fit_options))
            rows.append(row(label, um, fit_seconds))
            models[label] = um
        plain = plain or (label if [entry["name"] for entry in spec] == ["none"] else None)
        if add_temperature:
            with steps.step(f"{label} + temperature"):
                stacked, temperature_seconds = _with_temperature(um, cal_loader)
                rows.append(row(f"{label} + temperature", stacked, fit_seconds + temperature_seconds))
                models[rows[-1].label] = stacked
    with steps.step(REPORT_STEP):
        plain = plain or rows[0].label
        merged = merged_rows(rows, models, plain)
        rows = without(rows, merged, lambda one: one.label)
        story = shift_story(rows, models, plain, shift_loader, best=best, seed=seed, progress=False)
        found = demo_verdict(rows, plain, seed=seed)
        omitted = left_out(methods, every_row=every_row)
        for one in rows:
            one.story, one.verdict, one.merged, one.left_out = story, found, merged, omitted
        _write_outputs(rows, out_dir)
    steps.close()
    return rows


def merged_rows(rows: list[DemoRow], models: dict[str, UncertainModel], plain: str) -> list[Merged]:
    """The rows that predict the same as another (every test, shifted and OOD example), merged into it; the plain
    row and an auto row are never merged away (:func:`posthoc.evaluation.duplicates.merge_identical`)."""

    def predictions(one: DemoRow) -> list[Tensor | None]:
        shifted = one.shift.reports[one.label]
        values = one.report.ood_values or {}
        return [
            one.report.probs,
            *(shifted[key].probs for key in sorted(shifted)),
            *(value for name in sorted(values) for value in values[name]),
        ]

    def why(label: str, into: str) -> str:
        if models[label].methods[-1] == "temperature":
            return "its temperature kept T = 1"
        return "the same held-out choice"

    keep = [plain, *(one.label for one in rows if one.report.selection)]
    return merge_identical({one.label: predictions(one) for one in rows}, keep=keep, why=why)


def demo_verdict(rows: list[DemoRow], plain: str, *, seed: int = 0) -> Verdict:
    """The verdict on the demo's rows against the ``plain`` one: auto's pick (when an auto row is there) with its
    change in distribution, under the evaluation shifts at each severity (mean over the kinds, paired per digit) and
    on the held-out digits, and its predict cost.

    Example:
        >>> demo_verdict(rows, "MAP").sentence()[:22]  # rows of the whole demo (minutes)  # doctest: +SKIP
        '**Use `auto`** for thi'
    """
    candidates = [
        candidate(
            row.report,
            shifted=row.shift.example_nll(row.label),
            predict_cost=row.predict_ratio,
            forward_seconds=row.forward_seconds,
        )
        for row in rows
    ]
    return judge(
        candidates,
        plain,
        ci=CI,
        bootstraps=BOOTSTRAPS,
        seed=seed,
        auto_hint='`posthoc.wrap(model, method="auto")`',
        shift_hint="posthoc.evaluate_shift",
        shift_note=f"each the mean over {', '.join(SHIFT_KINDS)} on the first {SHIFT_EXAMPLES} test digits",
    )


def ood_section(rows: list[DemoRow], ood: ood_report.OODValues) -> str:
    """Markdown: every post-hoc score of the plain model on the held-out digits, then each method's entropy / MI
    next to the best of them."""
    table = {name: metrics.ood_metrics(*pair) for name, pair in ood.items()}
    bounds = {name: bootstrap.auroc_interval(*pair, ci=CI, bootstraps=SHIFT_BOOTSTRAPS) for name, pair in ood.items()}
    return (
        "### OOD (held-out digits 8 and 9): post-hoc scores of the plain model\n\n"
        + ood_report.ood_markdown({"MAP": table}, {"MAP": bounds})
        + "\n\n### OOD: each method's entropy (H) and mutual information (MI) next to the best post-hoc score\n\n"
        + ood_report.comparison_markdown(table, {row.label: row.report.ood for row in rows})
        + "\n\n### OOD: AUROC of every score, per method\n\n"
        + ood_report.every_score_markdown({row.label: row.report.ood for row in rows}, table)
        + "\n\nentropy, mutual-information, "
        + ", ".join(PREDICTIVE_OOD_SCORES)
        + " come from each method's own "
        "predictive; the scores marked * read the checkpoint's logits or features, which the methods leave unchanged "
        "(SWAG and iBNN, which fine-tune a copy, are scored on the checkpoint too)."
        + "\n\nEvery score is larger for inputs that look more OOD; FPR95: fraction of test digits flagged at the "
        f"threshold that flags 95% of the held-out digits; AUROC intervals from {SHIFT_BOOTSTRAPS} resamples.\n"
    )


#: how each shift kind's parameter reads in the report
_PARAMETER_WORDS = {
    "rotate": "rotation by {} degrees",
    "contrast": "contrast factor {}",
    "translate": "translation by {} of the side",
    "occlude": "a black square of {} of the side",
}


def severity_sentence(kinds: tuple[str, ...] = SHIFT_KINDS, severities: tuple[int, ...] = SEVERITIES) -> str:
    """What each kind's severities mean, e.g. ``rotation by 15 / 45 / 90 degrees, contrast factor 0.4 / ...``."""
    parts = []
    for kind in kinds:
        values = " / ".join(f"{PARAMETERS[kind][s - 1]:g}" for s in severities)
        parts.append(_PARAMETER_WORDS.get(kind, kind + " {}").format(values))
    return ", ".join(parts)


def featured(rows: list[DemoRow]) -> list[DemoRow]:
    """The rows the plots draw: the plain model, the recommended row and the few best (the verdict's
    :meth:`~posthoc.evaluation.verdict.Verdict.featured`); every row without a verdict."""
    found = rows[0].verdict
    labels = set(found.featured()) if found is not None else {row.label for row in rows}
    return [row for row in rows if row.label in labels]


def _notes(rows: list[DemoRow]) -> str:
    """What was merged and what was left out, one line each ("" when neither)."""
    notes = [merge_note(rows[0].merged or [])]
    if rows[0].left_out:
        notes.append(
            "Left out to run in about two minutes on 2 CPU cores: "
            + ", ".join(f"`{label}`" if "`" not in label else label for label in rows[0].left_out)
            + " (`posthoc demo --all` runs every row, `--method NAME` every row of one method)."
        )
    return "".join(f"\n\n{note}" for note in notes if note)


#: the pictures after the tables: file -> what it shows
FIGURES = {
    "reliability.png": "Reliability diagrams on the test digits",
    "reliability_rotated45.png": "Reliability diagrams on the test digits rotated by 45 degrees",
    "risk_coverage.png": "Risk against coverage on the test digits",
    "shift.png": "NLL and ECE against severity (mean over the kinds)",
    "ood_scores.png": "The plain model's OOD scores: test digits 0-7 against the held-out 8 and 9",
}


def render(rows: list[DemoRow], out_dir: str | Path | None = None) -> str:
    """The demo's Markdown: the verdict and the frontier, the in-distribution table with costs, auto's held-out record,
    NLL and ECE under shift, and the OOD tables. With ``out_dir`` the two frontiers are drawn there and linked (the
    report); without it, the same text with no pictures."""
    main = markdown_table(
        [row.report for row in rows],
        {
            "fit × fwd": [f"{row.fit_ratio:.1f}" for row in rows],
            "predict × fwd": [cost_cell(row.predict_ratio, row.forward_seconds) for row in rows],
        },
    )
    shift = ShiftTable.merge([row.shift for row in rows])
    found = rows[0].verdict
    auto = next((row for row in rows if row.report.selection), None)
    title = f"test digits; NLL under shift: mean over {', '.join(SHIFT_KINDS)} at severities {', '.join(map(str, SEVERITIES))}"
    opening = "" if found is None else verdict_section(found, out_dir, title=title) + "\n"
    selection = (
        "" if auto is None else selection_section(auto.report.selection, out_dir, heading="###", label=auto.label)
    )
    return (
        "# posthoc demo: the bundled digits CNN\n\n"
        + opening
        + "### Digits 0–7, bundled CNN (OOD: held-out digits 8 and 9)\n\n"
        + main
        + f"\n\nIntervals: {CI:.0%} percentile bootstrap over the 1000 test digits ({BOOTSTRAPS} resamples). "
        + BEST_CAPTION
        + _notes(rows)
        + "\n"
        + ("" if not selection else "\n" + selection)
        + "\n### Under shift: test digits corrupted by posthoc.evaluate_shift\n\n"
        + shift.to_markdown()
        + f"\n\nSeverity {' / '.join(map(str, SEVERITIES))}: "
        + severity_sentence()
        + f" (posthoc.shift.SEVERITIES; no fit-time perturbation is one of these kinds), on the first "
        f"{SHIFT_EXAMPLES} test digits; intervals from {SHIFT_BOOTSTRAPS} resamples.\n"
        + ("" if rows[0].story is None else "\n" + rows[0].story.markdown())
        + ("" if rows[0].post_hoc_ood is None else "\n" + ood_section(rows, rows[0].post_hoc_ood))
    )


def pictures(rows: list[DemoRow]) -> str:
    """The Markdown of the pictures after the tables: each figure with a caption saying which rows it draws."""
    drawn = ", ".join(f"`{row.label}`" for row in featured(rows))
    parts = ["### Pictures", ""]
    for name, what in FIGURES.items():
        who = "" if name == "ood_scores.png" else f" ({drawn}; every row is in the tables)"
        parts += [f"![{what}]({name})", "", f"{what}{who}.", ""]
    return "\n".join(parts)


def _write_outputs(rows: list[DemoRow], out_dir: Path) -> None:
    drawn = featured(rows)
    curves = {row.label: (row.report.probs, row.report.labels) for row in drawn}
    plots.reliability_diagram(curves, out_dir / "reliability.png")
    rotated45 = {row.label: row.shift.reports[row.label]["rotate", ROTATED45] for row in rows}
    rotated = {label: (report.probs, report.labels) for label, report in rotated45.items()}
    plots.reliability_diagram({row.label: rotated[row.label] for row in drawn}, out_dir / "reliability_rotated45.png")
    story = rows[0].story
    if story is not None:
        figures.confidence_plot(story.table, out_dir / "confidence.png", story.labels)
        plots.reliability_diagram(
            {label: rotated[label] for label in story.labels}, out_dir / "reliability_rotated45_best.png"
        )
    plots.risk_coverage_curve(curves, out_dir / "risk_coverage.png")
    figures.shift_plot(ShiftTable.merge([row.shift for row in drawn]), out_dir / "shift.png")
    ood_histograms(
        rows[0].post_hoc_ood, out_dir / "ood_scores.png", title="plain model: test digits 0-7 against held-out 8 and 9"
    )
    markdown = render(rows, out_dir) + "\n" + pictures(rows)
    (out_dir / "report.md").write_text(markdown)
    page.write_markdown_page(markdown, out_dir / "report.html", title="posthoc demo")


# ------------------------------------------------------------------------------------------- regression


#: (label, method, wrap options) of the rows; "ensemble" wraps three members trained with other seeds
REGRESSION_CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("plain (noise on val)", "none", {}),
    ("Laplace (last layer, kron)", "laplace", {}),
    ("MC dropout", "mc-dropout", {}),
    ("VI (head)", "vi", {}),
    ("ensemble of 3", "ensemble", {}),
)
MEMBER_SEEDS = (0, 1, 2)
#: Adam epochs of the trained MLPs (full batch) on the sinusoid and on Auto MPG
SINUSOID_EPOCHS, AUTO_MPG_EPOCHS = 1000, 400


def _fitted_regressor(
    label: str,
    method: str,
    options: dict[str, Any],
    members: list[torch.nn.Module],
    task: data.RegressionData,
    progress: bool,
) -> UncertainModel:
    if progress:
        print(f"fitting {label} ...", flush=True)
    model = members if method == "ensemble" else members[0]
    um = wrap(model, method="none" if method == "ensemble" else method, likelihood="regression", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small data: the curvature warnings say what the table shows
        return um.fit(task.train_loader(), task.val_loader(), progress=False)


def _sinusoid_part(out: Path, progress: bool) -> list[str]:
    task = data.sinusoid()
    members = [data.train_mlp(task.train, seed=seed, epochs=SINUSOID_EPOCHS) for seed in MEMBER_SEEDS]
    grid = torch.linspace(-2.4, 3.4, 300)[:, None]
    rows, bands = [], {}
    for label, method, options in REGRESSION_CONFIGS:
        um = _fitted_regressor(label, method, options, members, task, progress)
        std = {
            name: float(um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean())
            for name, x in task.regions.items()
        }
        rows.append(
            [
                label,
                f"{std['train']:.3f}",
                f"{std['gap']:.3f}",
                f"{std['beyond']:.3f}",
                f"{std['gap'] / std['train']:.2f}x",
            ]
        )
        bands[label] = gaussian_metrics.components(um.predict(grid, generator=torch.Generator().manual_seed(0)))
    plots.predictive_band(grid[:, 0], bands, (task.train[0][:, 0], task.train[1][:, 0]), out / "regression_band.png")
    return [
        "### The seed 004 sinusoid: does the predictive widen where the data ends?",
        "",
        "40 training points in two clusters; mean predictive std (targets' units):",
        "",
        *markdown_rows(
            ["method", "on the training points", "in the gap", "beyond the data", "gap / training"], rows
        ).splitlines(),
        "",
        "![the predictive band of each method over the training points](regression_band.png)",
        "",
    ]


def _auto_mpg_part(out: Path, progress: bool) -> list[str]:
    task = data.auto_mpg(0, split="extrapolate")
    members = [data.train_mlp(task.train, seed=seed, epochs=AUTO_MPG_EPOCHS) for seed in MEMBER_SEEDS]
    x, y = task.test
    rows, curves = [], {}
    for label, method, options in REGRESSION_CONFIGS:
        um = _fitted_regressor(label, method, options, members, task, progress)
        means, stds = gaussian_metrics.components(um.predict(x, generator=torch.Generator().manual_seed(0)))
        coverage, width = gaussian_metrics.interval_coverage(means, stds, y, 0.9)
        rows.append(
            [
                label,
                f"{gaussian_metrics.nll(means, stds, y):.3f}",
                f"{gaussian_metrics.rmse(means, y):.3f}",
                f"{gaussian_metrics.crps(means, stds, y):.3f}",
                f"{coverage:.3f}",
                f"{width:.2f}",
                f"{gaussian_metrics.calibration_error(means, stds, y):.3f}",
                f"{gaussian_metrics.ence(means, stds, y, bins=5):.3f}",
            ]
        )
        curves[label] = (means, stds, y)
    plots.calibration_curves(curves, out / "regression_calibration.png")
    plots.error_against_std(curves, out / "regression_error_std.png", bins=5)
    return [
        "### Auto MPG: tested on the heaviest 30 % of the cars, trained on the lighter 70 %",
        "",
        "Standardised miles per gallon; lower NLL, RMSE, CRPS, MACE and ENCE are better; a calibrated 90 % "
        "interval covers 0.9 of the cars.",
        "",
        *markdown_rows(
            ["method", "NLL", "RMSE", "CRPS", "90% coverage", "90% width", "MACE", "ENCE"], rows
        ).splitlines(),
        "",
        "![observed against expected interval coverage](regression_calibration.png)",
        "",
        "![RMSE against predicted std, per bin](regression_error_std.png)",
        "",
    ]


def _regression_shift_part(out: Path, progress: bool) -> list[str]:
    task = data.auto_mpg(0, split="shift")
    members = [data.train_mlp(task.train, seed=seed, epochs=AUTO_MPG_EPOCHS) for seed in MEMBER_SEEDS]
    tables = [
        evaluate_shift(
            {label: _fitted_regressor(label, method, options, members, task, progress)},
            task.shift_loaders(),
            progress=False,
        )
        for label, method, options in REGRESSION_CONFIGS
    ]
    table = ShiftTable.merge(tables)
    figures.shift_plot(table, out / "regression_shift.png")
    return [
        "### Auto MPG under shift: random cars, heavier cars, and a gap of middle weights",
        "",
        "Fitted on the lighter 70 % of the cars without those between the 0.4 and 0.6 quantiles of their weight; "
        "scored by posthoc.evaluate_shift on random held-out cars, on the heavier 30 % (extrapolation) and on the "
        "left-out band (gap).",
        "",
        table.to_markdown(),
        "",
        "![NLL, CRPS and 90 % coverage per test set](regression_shift.png)",
        "",
    ]


def run_regression_demo(out_dir: str | Path = "posthoc-demo", *, progress: bool = True) -> str:
    """Fit every regression row on both data sets, write the PNGs and ``regression.md`` into ``out_dir`` and return the
    Markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    lines = [
        "## Regression: posthoc on a trained MLP",
        "",
        *_sinusoid_part(out, progress),
        *_auto_mpg_part(out, progress),
        *_regression_shift_part(out, progress),
    ]
    lines.append(f"Fitted and evaluated in {time.perf_counter() - start:.0f} s.")
    markdown = "\n".join(lines) + "\n"
    (out / "regression.md").write_text(markdown)
    return markdown
