"""The verdict that opens every report comparing methods: which method to use for this model, and its numbers.

A report that compares methods on one model opens with one sentence: the recommended method, what it costs in
distribution (its NLL change against the plain model with a paired bootstrap interval over the test examples),
what it buys under each shift (the same, on the shifted test sets; without them, on the fit-time perturbed
held-out copies of ``method="auto"``'s selection record), its OOD AUROC change, and its predict cost against a
plain forward. Then comes the frontier (:func:`posthoc.evaluation.plots.frontier`): every row's in-distribution
NLL excess against its NLL under shift.

Which method is recommended:

- where a row is ``method="auto"`` (its :class:`Candidate` carries the selection record), auto's choice: it was
  made on held-out data, before the test set was seen;
- otherwise the rule of :mod:`posthoc.engine.selection` applied to the test rows: among the rows whose
  in-distribution NLL excess over the plain model has a one-sided paired bootstrap upper bound (at the selection
  step's confidence, 95 %) within the
  tolerance (``max(2 % of the plain NLL, 0.005 nats)``), the one of lowest NLL under the shifts (mean over them;
  without shifts, the lowest NLL in distribution). The verdict then says that the pick is made on the test data
  and that ``auto`` makes it on held-out data;
- when that is the plain model, the verdict says to keep it.

Example:
    >>> from posthoc.evaluation.comparison import example_nll     # per-example NLL of a report
    >>> rows = [Candidate("none", example_nll(plain_report), {"noisy": example_nll(plain_noisy_report)}),
    ...         Candidate("laplace", example_nll(report), {"noisy": example_nll(noisy_report)}, predict_cost=1.4)]
    >>> verdict = judge(rows, plain="none")
    >>> verdict.recommended, verdict.basis
    ('laplace', 'test')
    >>> print(verdict.markdown("frontier.png"))          # "## Verdict", the sentence, the frontier
    ## Verdict
    <BLANKLINE>
    **Use `laplace`** for this model: in distribution the NLL changes by -0.0661 [-0.1333, -0.0128] nats ...
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from torch import Tensor

from posthoc.core.model_card import selection_table
from posthoc.engine.selection import CONFIDENCE, Tolerance
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap, metrics, plots
from posthoc.evaluation.plots import FrontierPoint

#: the two-sided level of every change's interval in the sentence
CI = 0.95
#: bootstrap resamples of the test examples
BOOTSTRAPS = 1000
#: the central level of the frontier's bars: the right end of the excess bar is the one-sided bound that decides
#: admissibility on the test data (``2 * CONFIDENCE - 1``)
FRONTIER_LEVEL = 2 * CONFIDENCE - 1
#: the knob of a selection record that chose between whole methods (``method="auto"``)
METHOD_KNOB = "method"
#: the file name reports give the frontier of their rows
FRONTIER_FILE = "frontier.png"
#: the file name reports give the frontier of auto's candidates on held-out data (its selection record)
SELECTION_FRONTIER_FILE = "selection_frontier.png"


@dataclass(frozen=True)
class Candidate:
    """What the verdict reads of one method row.

    Attributes:
        label: the row's name.
        clean: ``(N,)`` per-example NLL on the test set (the same examples, in the same order, for every row).
        shifted: per shift, ``(M,)`` per-example NLL on that shifted test set (paired with the plain row's).
        ood: ``(test scores, OOD scores)`` of the row's predictive entropy, when an OOD set was given.
        predict_cost: the row's predict time over a plain forward's (``None``: not measured).
        selection: ``method="auto"``'s selection record (``um.summary()["selection"]``), for an auto row.
    """

    label: str
    clean: Tensor
    shifted: Mapping[str, Tensor] = field(default_factory=dict)
    ood: tuple[Tensor, Tensor] | None = None
    predict_cost: float | None = None
    selection: Mapping[str, Any] | None = None

    @property
    def is_auto(self) -> bool:
        """Whether the row is ``method="auto"`` (a selection record between whole methods)."""
        return bool(self.selection) and self.selection.get("knob") == METHOD_KNOB


@dataclass(frozen=True)
class Change:
    """A row's change against the plain model on the same examples: ``difference`` (row minus plain) with its central
    ``ci`` interval and its one-sided :data:`~posthoc.engine.selection.CONFIDENCE` upper bound (paired bootstrap),
    the plain model's value, and ``band``: the central :data:`FRONTIER_LEVEL` interval (its upper end is ``upper``).
    """

    difference: float
    interval: tuple[float, float]
    upper: float
    plain: float
    band: tuple[float, float]

    @property
    def value(self) -> float:
        """The row's own value (plain plus difference)."""
        return self.plain + self.difference

    @property
    def ratio(self) -> float:
        """The row's value over the plain model's (``nan`` when the plain value is 0)."""
        return self.value / self.plain if self.plain else math.nan


@dataclass(frozen=True)
class Judged:
    """One row judged against the plain model on the test data.

    ``clean``: its in-distribution NLL change; ``shifts``: its NLL change per shift; ``shift_nll`` / ``shift_band``:
    its NLL under shift (mean over the shifts) with the central :data:`FRONTIER_LEVEL` interval; ``ood``: its OOD
    AUROC change; ``admissible``: whether ``clean.upper`` is within the tolerance.
    """

    label: str
    clean: Change
    shifts: dict[str, Change]
    shift_nll: float | None
    shift_band: tuple[float, float] | None
    ood: Change | None
    predict_cost: float | None
    admissible: bool
    selection: Mapping[str, Any] | None = None


def _mean_draws(values: Tensor, index: Tensor) -> np.ndarray:
    """The mean of ``values`` over each resample of ``index`` ``(B, N)``: ``(B,)``."""
    return bootstrap.draws({"mean": bootstrap.mean_of(values.double().cpu())}, index, ["mean"])["mean"]


def _change(draws: np.ndarray, difference: float, plain: float, ci: float) -> Change:
    """A :class:`Change` from the bootstrap ``draws`` of a paired difference."""
    low, high = np.quantile(draws, [(1 - ci) / 2, (1 + ci) / 2])
    band = np.quantile(draws, [1 - CONFIDENCE, CONFIDENCE])
    return Change(difference, (float(low), float(high)), float(band[1]), plain, (float(band[0]), float(band[1])))


class _Resamples:
    """One seeded resample matrix per example count, shared by every row (so that differences are paired), and the
    plain model's OOD AUROC draws, drawn once for every row."""

    def __init__(self, bootstraps: int, seed: int) -> None:
        self.bootstraps, self.seed, self.found = bootstraps, seed, {}
        self.plain_ood: np.ndarray | None = None

    def plain_auroc(self, plain: tuple[Tensor, Tensor]) -> np.ndarray:
        """The plain model's OOD AUROC draws (computed on the first call)."""
        if self.plain_ood is None:
            self.plain_ood = bootstrap.auroc_draws(*plain, self.bootstraps, self.seed).numpy()
        return self.plain_ood

    def __call__(self, n: int, stream: int = 0) -> Tensor:
        key = (n, stream)
        if key not in self.found:
            self.found[key] = bootstrap.resample_index(n, self.bootstraps, self.seed + stream)
        return self.found[key]


def paired_change(row: Tensor, plain: Tensor, index: Tensor, ci: float = CI) -> Change:
    """The change of the mean of per-example ``row`` values against ``plain`` ones (same examples), resampled by
    ``index``.

    Example:
        >>> index = bootstrap.resample_index(4, 200)
        >>> paired_change(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 1.0, 3.0, 3.0]), index).difference
        0.5
    """
    if row.shape != plain.shape:
        raise InputError(
            f"a paired change needs the same examples in both rows; got {tuple(row.shape)} and "
            f"{tuple(plain.shape)} values: evaluate every method on the same loader, without shuffling"
        )
    differences = row.double().cpu() - plain.double().cpu()
    return _change(_mean_draws(differences, index), float(differences.mean()), float(plain.double().mean()), ci)


def auroc_change(
    row: tuple[Tensor, Tensor],
    plain: tuple[Tensor, Tensor],
    *,
    ci: float = CI,
    bootstraps: int = BOOTSTRAPS,
    seed: int = 0,
    plain_draws: np.ndarray | None = None,
) -> Change:
    """The OOD AUROC change of ``row``'s ``(test scores, OOD scores)`` against ``plain``'s, paired: both are resampled
    with the same draws of test and OOD examples (:func:`posthoc.evaluation.bootstrap.auroc_draws` with one seed);
    ``plain_draws`` reuses the plain model's draws (the same ``bootstraps`` and ``seed``) across rows.

    Example:
        >>> change = auroc_change(report.ood_values["entropy"], plain_report.ood_values["entropy"])
        >>> change.difference, change.interval     # laplace's entropy separates the OOD inputs better
        (0.197, (0.156, 0.236))
    """
    ours = bootstrap.auroc_draws(*row, bootstraps, seed).numpy()
    theirs = bootstrap.auroc_draws(*plain, bootstraps, seed).numpy() if plain_draws is None else plain_draws
    value, reference = metrics.ood_auroc(*row), metrics.ood_auroc(*plain)
    return _change(ours - theirs, value - reference, reference, ci)


def _shift_level(candidate: Candidate, keys: Sequence[str], resamples: _Resamples) -> tuple[float, tuple[float, float]]:
    """NLL under shift, the mean over the shifts ``keys`` of the mean NLL on each, and its central
    :data:`FRONTIER_LEVEL` interval (each shift resampled on its own stream, the same for every row)."""
    values = [candidate.shifted[key] for key in keys]
    draws = np.mean([_mean_draws(v, resamples(len(v), 1 + i)) for i, v in enumerate(values)], axis=0)
    low, high = np.quantile(draws, [1 - CONFIDENCE, CONFIDENCE])
    return float(np.mean([float(v.double().mean()) for v in values])), (float(low), float(high))


def _judge(
    candidate: Candidate,
    plain: Candidate,
    tolerance: float,
    resamples: _Resamples,
    *,
    ci: float,
    bootstraps: int,
    seed: int,
) -> Judged:
    """One row against the plain one (see :class:`Judged`)."""
    clean = paired_change(candidate.clean, plain.clean, resamples(len(plain.clean)), ci)
    keys = [key for key in plain.shifted if key in candidate.shifted]
    shifts = {
        key: paired_change(candidate.shifted[key], plain.shifted[key], resamples(len(plain.shifted[key]), 1 + i), ci)
        for i, key in enumerate(keys)
    }
    level, band = _shift_level(candidate, keys, resamples) if keys else (None, None)
    ood = None
    if candidate.ood is not None and plain.ood is not None:
        ood = auroc_change(
            candidate.ood,
            plain.ood,
            ci=ci,
            bootstraps=bootstraps,
            seed=seed,
            plain_draws=resamples.plain_auroc(plain.ood),
        )
    return Judged(
        candidate.label,
        clean,
        shifts,
        level,
        band,
        ood,
        candidate.predict_cost,
        clean.upper <= tolerance,
        candidate.selection,
    )


@dataclass
class Verdict:
    """Which method to use for this model, and why (see the module docs); :meth:`sentence` says it in one sentence.

    ``basis``: ``"auto"`` (auto's held-out choice), ``"test"`` (the rule on the test rows, ranked under shift) or
    ``"test-clean"`` (the rule on the test rows without shifts: the lowest NLL in distribution). ``rows`` are every
    row judged against the plain one, in their order; ``tolerance`` is in nats per test example.
    """

    plain: str
    recommended: str
    basis: str
    rows: list[Judged]
    tolerance: float
    examples: int
    ci: float = CI
    bootstraps: int = BOOTSTRAPS
    auto_hint: str = '`method="auto"`'
    shift_hint: str = "evaluate the methods on a shifted test set too"
    shift_note: str = ""

    def row(self, label: str) -> Judged:
        """The judged row ``label``."""
        return next(row for row in self.rows if row.label == label)

    @property
    def keeps_plain(self) -> bool:
        """Whether the verdict is to keep the plain model (the rule picks it, or auto chose ``none``)."""
        chosen = self.row(self.recommended)
        auto_kept_plain = chosen.selection is not None and chosen.selection.get("chosen") == "none"
        return self.recommended == self.plain or auto_kept_plain

    @property
    def shifts(self) -> list[str]:
        """The shifts the rows were compared under (those of the plain row)."""
        return list(self.row(self.plain).shifts)

    # ---- the sentence ----------------------------------------------------------------------------------------------
    def sentence(self) -> str:
        """The verdict in one sentence (plus, for a pick made on the test data, one saying so).

        Example:
            >>> verdict.sentence()
            '**Use `laplace`** for this model: in distribution the NLL changes by -0.0661 [-0.1333, -0.0128] nats ...'
        """
        chosen = self.row(self.recommended)
        if self.keeps_plain:
            return self._keep_plain(chosen)
        clauses = self._numbers(chosen)
        if chosen.selection is not None:
            clauses.insert(
                0,
                f"on held-out data it picked `{chosen.selection['chosen']}` among "
                f"{len(chosen.selection.get('candidates', []))} candidates",
            )
            if not chosen.admissible:
                clauses.insert(
                    2,
                    f"on these test examples its {CONFIDENCE:.0%} excess bound {chosen.clean.upper:+.4f} "
                    f"is over the {self.tolerance:.4f} tolerance",
                )
        return f"**Use `{chosen.label}`** for this model: " + "; ".join(clauses) + "." + self._basis_note()

    def _numbers(self, row: Judged) -> list[str]:
        """The clauses of the sentence: in distribution, under shift, OOD, predict cost."""
        clauses = [
            f"in distribution the NLL changes by {_signed(row.clean.difference)} {_interval(row.clean.interval)} "
            f"nats ({row.clean.ratio:.2f}x the plain model's {row.clean.plain:.4f})"
        ]
        if row.shifts:
            parts = [
                f"{_signed(change.difference)} {_interval(change.interval)} ({change.ratio:.2f}x) {_where(name)}"
                for name, change in row.shifts.items()
            ]
            clauses.append("under shift by " + ", ".join(parts) + (f" ({self.shift_note})" if self.shift_note else ""))
        else:
            clauses.append(self._held_out_shift(row))
        if row.ood is not None:
            clauses.append(
                f"OOD AUROC {_signed(row.ood.difference, 3)} {_interval(row.ood.interval, 3)} "
                f"({row.ood.plain:.3f} -> {row.ood.value:.3f})"
            )
        clauses.append(
            "predict cost not measured"
            if row.predict_cost is None
            else f"predict {row.predict_cost:.1f}x a plain forward"
        )
        return clauses

    def _held_out_shift(self, row: Judged) -> str:
        """Without test shifts: the change on auto's fit-time perturbed held-out copies, from its record."""
        record = row.selection
        chosen = _chosen_record(record) if record else None
        plain = (record or {}).get("plain", {}).get("shifted_nll")
        if chosen is None or chosen.get("shifted_nll") is None or not plain:
            return f"no shift was given ({self.shift_hint} to see what it buys under shift)"
        value = chosen["shifted_nll"]
        return (
            f"on the {record.get('perturbed')} fit-time perturbed copies of the held-out data its NLL changes by "
            f"{_signed(value - plain)} ({value / plain:.2f}x; no test shift was given: {self.shift_hint})"
        )

    def _basis_note(self) -> str:
        """For a pick made on the test data: say so, and where auto makes it."""
        if self.basis == "auto":
            return ""
        ranked = "under shift" if self.basis == "test" else "in distribution (no shift was given)"
        return (
            f" Picked on the test data: the lowest NLL {ranked} among the rows whose in-distribution NLL excess has "
            f"a {CONFIDENCE:.0%} paired upper bound within {self.tolerance:.4f} nats; {self.auto_hint} makes this "
            "choice on held-out data."
        )

    def _keep_plain(self, chosen: Judged) -> str:
        """The sentence when nothing beats the plain model."""
        if chosen.selection is not None:
            return (
                f"**Keep the plain model**: `auto` found no candidate worth its cost on held-out data (it picked "
                f"`none` among {len(chosen.selection.get('candidates', []))} candidates)."
            )
        others = [row for row in self.rows if row.label != self.plain and row.shift_nll is not None]
        text = (
            "**Keep the plain model**: no method lowers the NLL under shift while its in-distribution excess stays "
            f"within {self.tolerance:.4f} nats at {CONFIDENCE:.0%} confidence"
            if self.basis == "test"
            else "**Keep the plain model**: no method lowers the in-distribution NLL, and no shift was given "
            f"({self.shift_hint} to see what it buys under shift)"
        )
        best = min(others, key=lambda row: row.shift_nll, default=None)
        plain_shift = self.row(self.plain).shift_nll
        if best is not None and plain_shift is not None and best.shift_nll < plain_shift and not best.admissible:
            text += (
                f" (`{best.label}` would buy {best.shift_nll / plain_shift:.2f}x under shift but costs "
                f"{_signed(best.clean.difference)} {_interval(best.clean.interval)} nats in distribution, bound "
                f"{best.clean.upper:+.4f})"
            )
        return text + "." + self._basis_note()

    # ---- Markdown and the frontier ---------------------------------------------------------------------------------
    def caption(self) -> str:
        """What the numbers and the frontier's bars are."""
        return (
            f"Changes against the plain model `{self.plain}` with {self.ci:.0%} paired bootstrap intervals over the "
            f"{self.examples} test examples ({self.bootstraps} resamples). Frontier: one point per row, its "
            f"in-distribution NLL excess against its NLL under shift (mean over the shifts), bars "
            f"{FRONTIER_LEVEL:.0%} central intervals (an excess bar's right end is the {CONFIDENCE:.0%} upper "
            f"bound); shaded: admissible (bound within {self.tolerance:.4f} nats); hollow: refused; star: "
            "recommended."
        )

    def markdown(self, frontier: str | None = None) -> str:
        """``## Verdict``, the sentence, the frontier image ``frontier`` (a file name, when drawn) and the caption."""
        parts = ["## Verdict", "", self.sentence(), ""]
        if frontier is not None:
            parts += [f"![frontier: in-distribution cost against NLL under shift]({frontier})", ""]
        return "\n".join(parts + [self.caption(), ""])

    def frontier_points(self) -> list[FrontierPoint]:
        """The rows measured under shift as :class:`~posthoc.evaluation.plots.FrontierPoint` (test data)."""
        return [
            FrontierPoint(
                row.label,
                row.clean.difference,
                row.clean.band,
                row.shift_nll,
                row.shift_band,
                row.admissible,
                row.label == self.recommended,
            )
            for row in self.rows
            if row.shift_nll is not None
        ]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for metrics.json: the pick, its basis, the sentence, and every row's changes."""

        def change(found: Change | None) -> dict[str, Any] | None:
            return (
                None
                if found is None
                else {
                    "difference": found.difference,
                    "interval": list(found.interval),
                    "upper": found.upper,
                    "plain": found.plain,
                }
            )

        return {
            "recommended": self.recommended,
            "basis": self.basis,
            "keeps_plain": self.keeps_plain,
            "tolerance": self.tolerance,
            "ci": self.ci,
            "sentence": self.sentence(),
            "rows": [
                {
                    "label": row.label,
                    "admissible": row.admissible,
                    "clean_nll": change(row.clean),
                    "shift_nll": row.shift_nll,
                    "shifts": {k: change(v) for k, v in row.shifts.items()},
                    "ood_auroc": change(row.ood),
                    "predict_cost": row.predict_cost,
                }
                for row in self.rows
            ],
        }


def _signed(value: float, digits: int = 4) -> str:
    """``+0.0123`` / ``-0.0123``; a change that shows as zero at ``digits`` is ``±0.0000`` (not ``-0.0000``)."""
    text = f"{value:+.{digits}f}"
    return "±" + text[1:] if float(text) == 0 else text


def _interval(interval: tuple[float, float], digits: int = 4) -> str:
    return f"[{_signed(interval[0], digits)}, {_signed(interval[1], digits)}]"


def _where(name: str) -> str:
    """How a shift reads in the sentence: ``at severity 3`` for a severity, ``on `rotated/``` for a named set."""
    return f"at {name}" if name.startswith("severity ") else f"on `{name}`"


def _chosen_record(selection: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((row for row in selection.get("candidates", []) if row.get("chosen")), None)


def judge(
    candidates: Sequence[Candidate],
    plain: str,
    *,
    tolerance: float | None = None,
    ci: float = CI,
    bootstraps: int = BOOTSTRAPS,
    seed: int = 0,
    auto_hint: str = '`method="auto"`',
    shift_hint: str = "evaluate the methods on a shifted test set too",
    shift_note: str = "",
) -> Verdict:
    """Judge every row against the ``plain`` one on the test data and recommend one (module docs).

    ``tolerance``: nats per example (default ``max(2 % of the plain model's test NLL, 0.005)``); ``auto_hint`` and
    ``shift_hint`` name, in the caller's terms, how to make the choice on held-out data and how to add a shift
    (the CLI: ``--method auto``, ``--shift``); ``shift_note`` says what the shifts are (e.g. the kinds averaged at
    each severity).

    Example:
        >>> from posthoc.evaluation.comparison import example_nll
        >>> found = judge([Candidate("none", example_nll(plain_report)), Candidate("laplace", example_nll(report))],
        ...               plain="none")
        >>> found.recommended, found.basis        # no shifted rows: the lowest NLL in distribution
        ('laplace', 'test-clean')
    """
    labels = [candidate.label for candidate in candidates]
    if plain not in labels:
        raise ConfigError(f"no row {plain!r} to judge the others against; rows: {', '.join(labels)}")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"rows need distinct labels to be judged; got {labels}")
    bootstrap.check_level(ci, bootstraps)
    reference = candidates[labels.index(plain)]
    for candidate in candidates:
        if candidate.clean.shape != reference.clean.shape:
            raise InputError(
                f"row {candidate.label!r} has {candidate.clean.numel()} test examples, the plain row "
                f"{reference.clean.numel()}: evaluate every method on the same test loader"
            )
    limit = Tolerance().nats(float(reference.clean.double().mean())) if tolerance is None else float(tolerance)
    resamples = _Resamples(bootstraps, seed)
    rows = [
        _judge(candidate, reference, limit, resamples, ci=ci, bootstraps=bootstraps, seed=seed)
        for candidate in candidates
    ]
    auto = next((candidate.label for candidate in candidates if candidate.is_auto), None)
    if auto is not None:
        recommended, basis = auto, "auto"
    else:
        admissible = [row for row in rows if row.admissible]
        ranked_by_shift = all(row.shift_nll is not None for row in admissible)
        basis = "test" if ranked_by_shift and rows[labels.index(plain)].shifts else "test-clean"
        key = (lambda row: row.shift_nll) if basis == "test" else (lambda row: row.clean.value)
        recommended = min(admissible, key=key).label
    return Verdict(
        plain,
        recommended,
        basis,
        rows,
        limit,
        reference.clean.numel(),
        ci,
        bootstraps,
        auto_hint,
        shift_hint,
        shift_note,
    )


def selection_points(selection: Mapping[str, Any]) -> list[FrontierPoint]:
    """The candidates of a selection record (``um.summary()["selection"]``) as frontier points on held-out data: the
    excess with a bar up to its one-sided bound, the NLL on the perturbed copies with a bar of the same level;
    candidates not tried, not finite or without perturbed copies are left out.

    Example:
        >>> points = selection_points(um.summary()["selection"])
        >>> len(points), points[0].label, points[-1].label    # laplace's prior precisions
        (20, '1e+08', '10')
        >>> fig = plots.frontier(points, "selection.png", tolerance=um.summary()["selection"]["tolerance"])
    """
    z = NormalDist().inv_cdf(CONFIDENCE)
    points = []
    for row in selection.get("candidates", []):
        x, bound, y = row.get("excess"), row.get("bound"), row.get("shifted_nll")
        if x is None or bound is None or y is None or not all(math.isfinite(v) for v in (x, bound, y)):
            continue
        spread = row.get("shifted_nll_se")
        points.append(
            FrontierPoint(
                str(row["candidate"]),
                x,
                (x - (bound - x), bound),
                y,
                None if spread is None else (y - z * spread, y + z * spread),
                bool(row.get("admissible")),
                bool(row.get("chosen")),
            )
        )
    return points


def verdict_section(found: Verdict, out_dir: str | os.PathLike | None, *, title: str | None = None) -> str:
    """The verdict's Markdown with its frontier, drawn to ``out_dir/frontier.png`` when the rows were measured under
    shift (``title`` on the plot); without shifts or without ``out_dir``, the verdict alone.

    Example:
        >>> section = verdict_section(verdict, ".")      # draws ./frontier.png
        >>> print(section)
        ## Verdict
        <BLANKLINE>
        **Use `laplace`** for this model: in distribution the NLL changes by -0.0661 [-0.1333, -0.0128] nats ...
        <BLANKLINE>
        ![frontier: in-distribution cost against NLL under shift](frontier.png)
        ...
        >>> Path("frontier.png").exists()
        True
    """
    points = found.frontier_points()
    if not points or out_dir is None:
        return found.markdown()
    plots.frontier(points, Path(out_dir) / FRONTIER_FILE, tolerance=found.tolerance, title=title)
    return found.markdown(FRONTIER_FILE)


def selection_section(
    selection: Mapping[str, Any], out_dir: str | os.PathLike | None, *, heading: str = "##", label: str = "auto"
) -> str:
    """How ``method="auto"`` chose on held-out data: its selection record as a table and the frontier of its
    candidates (drawn to ``out_dir/selection_frontier.png`` when they were scored on perturbed copies and ``out_dir``
    is given).

    Example:
        >>> print(selection_section(um.summary()["selection"], "report"))
        ## How `auto` chose, on held-out data
        ...
    """
    lines = [f"{heading} How `{label}` chose, on held-out data", "", *selection_table(dict(selection)), ""]
    points = selection_points(selection)
    if points and out_dir is not None:
        plots.frontier(
            points,
            Path(out_dir) / SELECTION_FRONTIER_FILE,
            tolerance=float(selection["tolerance"]),
            ylabel="NLL on the fit-time perturbed copies",
            title=f"{label}'s candidates on held-out data (NLL excess cross-fitted)",
            chosen_word="chosen",
        )
        lines += [
            f"![{label}'s candidates on held-out data]({SELECTION_FRONTIER_FILE})",
            "",
            f"Bars: the excess from its mean to the bound that decides admissibility ({CONFIDENCE:.0%}, on new "
            f"data of the held-out size) and as far below; the perturbed NLL ± {NormalDist().inv_cdf(CONFIDENCE):.2f} "
            "standard errors; shaded: admissible; star: chosen.",
            "",
        ]
    return "\n".join(lines)
