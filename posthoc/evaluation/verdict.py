"""The verdict that opens every report comparing methods: which method to use for this model, and its numbers.

At most three lines of words: what to use, what it costs (its NLL change against the plain model in distribution,
and its predict cost against a plain forward) and what it buys (its NLL change under the shifts, else on auto's
fit-time perturbed held-out copies, and its OOD AUROC change). A table follows, each change with its paired bootstrap
interval over the test examples, then notes and the frontier (:func:`posthoc_apps.report.plots.frontier`).

Which method is recommended: where a row is ``method="auto"``, auto's choice (made on held-out data); otherwise the
rule of :mod:`posthoc.engine.selection` applied to the test rows: among the rows whose in-distribution NLL excess has
a one-sided paired bootstrap upper bound within the tolerance, the one of lowest NLL under the shifts (without
shifts, in distribution). When that is the plain model, the verdict says to keep it.

Example:
    >>> from posthoc.evaluation.verdict import Candidate, judge
    >>> from posthoc_apps.demo.examples import plain_report, plain_noisy_report, report, noisy_report
    >>> from posthoc.evaluation.comparison import example_nll     # per-example NLL of a report
    >>> rows = [Candidate("none", example_nll(plain_report), {"noisy": example_nll(plain_noisy_report)}),
    ...         Candidate("laplace", example_nll(report), {"noisy": example_nll(noisy_report)}, predict_cost=1.4)]
    >>> verdict = judge(rows, plain="none")
    >>> verdict.recommended, verdict.basis
    ('laplace', 'test')
    >>> print(verdict.markdown("frontier.png"))          # "## Verdict", the lines, the table, the frontier
    ## Verdict
    <BLANKLINE>
    **Use `laplace`**: picked on the test data, the lowest NLL under shift among the rows within the tolerance; ...
    <BLANKLINE>
    It lowers the NLL in distribution by 0.1068 nats (0.82x the plain model's 0.5966); a prediction costs 1.4x a ...
    <BLANKLINE>
    It buys -0.7046 nats of NLL under shift (0.59x on `noisy`).
    <BLANKLINE>
    | | `none` (plain) | `laplace` | change [95% interval] | ratio |
    ...
    | predict cost | 1.0x | 1.4x | – | 1.4x |
    ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np
from torch import Tensor

from posthoc.engine.selection import CONFIDENCE, Tolerance
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation import bootstrap, metrics

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
#: a plain NLL (nats) under which a change reads as a difference only: a ratio to nearly 0 reads as thousands of x
RATIO_FLOOR = 0.01
#: a plain forward faster than this (seconds) puts the predict cost's time in microseconds beside its ratio
MICROSECONDS_BELOW = 1e-3
#: rows a plot draws besides the plain and the recommended one (the rest stay in the tables)
FEATURED = 3


@dataclass(frozen=True)
class FrontierPoint:
    """One candidate on the frontier: its in-distribution NLL excess ``x`` and its NLL under shift ``y``, each with an
    interval (``None``: none).

    Example:
        >>> from posthoc.evaluation.verdict import FrontierPoint
        >>> FrontierPoint("laplace+dac", 0.002, (-0.001, 0.004), 0.41, (0.39, 0.43), admissible=True, chosen=True).chosen
        True
    """

    label: str
    x: float
    x_interval: tuple[float, float] | None
    y: float
    y_interval: tuple[float, float] | None
    admissible: bool
    chosen: bool = False


@dataclass(frozen=True)
class Candidate:
    """What the verdict reads of one method row: ``clean``, the ``(N,)`` per-example test NLL (the same examples in
    the same order for every row); ``shifted``, the same per shift; ``ood``, ``(test scores, OOD scores)`` of its
    predictive entropy; ``predict_cost``, its predict time over a plain forward's (taking ``forward_seconds``);
    ``selection``, ``method="auto"``'s selection record (``um.summary()["selection"]``).
    """

    label: str
    clean: Tensor
    shifted: Mapping[str, Tensor] = field(default_factory=dict)
    ood: tuple[Tensor, Tensor] | None = None
    predict_cost: float | None = None
    selection: Mapping[str, Any] | None = None
    forward_seconds: float | None = None

    @property
    def is_auto(self) -> bool:
        """Whether the row is ``method="auto"`` (a selection record between whole methods)."""
        return bool(self.selection) and self.selection.get("knob") == METHOD_KNOB


@dataclass(frozen=True)
class Change:
    """A row's change against the plain model (row minus plain, paired bootstrap): its central ``ci`` ``interval``,
    its one-sided :data:`~posthoc.engine.selection.CONFIDENCE` ``upper`` bound and the central :data:`FRONTIER_LEVEL`
    ``band``."""

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
    """One row judged against the plain model: ``shift_nll`` is its NLL under shift (mean over the shifts) with its
    central :data:`FRONTIER_LEVEL` ``shift_band``; ``admissible``: whether ``clean.upper`` is within the tolerance."""

    label: str
    clean: Change
    shifts: dict[str, Change]
    shift_nll: float | None
    shift_band: tuple[float, float] | None
    ood: Change | None
    predict_cost: float | None
    admissible: bool
    selection: Mapping[str, Any] | None = None
    forward_seconds: float | None = None


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
        >>> import torch
        >>> from posthoc.evaluation import bootstrap
        >>> from posthoc.evaluation.verdict import paired_change
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
    """The OOD AUROC change of ``row``'s ``(test scores, OOD scores)`` against ``plain``'s, both resampled with the
    same draws; ``plain_draws`` reuses the plain model's draws across rows.

    Example:
        >>> from posthoc.evaluation.verdict import auroc_change
        >>> from posthoc_apps.demo.examples import report, plain_report
        >>> change = auroc_change(report.ood_values["entropy"], plain_report.ood_values["entropy"])
        >>> change.difference, change.interval     # laplace's entropy separates the OOD inputs better
        (0.337, (0.281, 0.385))
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
        candidate.forward_seconds,
    )


@dataclass
class Verdict:
    """Which method to use for this model, and why (see the module docs).

    ``basis``: ``"auto"`` (auto's held-out choice), ``"test"`` (the rule on the test rows, ranked under shift) or
    ``"test-clean"`` (ranked in distribution, without shifts); ``tolerance`` is in nats per test example;
    ``disagreement``: for an auto pick, the row clearly better on the test data (:func:`disagreeing_row`).
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
    disagreement: tuple[str, Change] | None = None

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

    # ---- the words -------------------------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        """At most three lines of words: what to use, what it costs, what it buys."""
        chosen = self.row(self.recommended)
        if self.keeps_plain:
            return self._keep_plain(chosen)
        return [self._use(chosen), self._costs(chosen), self._buys(chosen)]

    def sentence(self) -> str:
        """:meth:`lines` as one paragraph (metrics.json keeps it)."""
        return " ".join(self.lines())

    def _use(self, chosen: Judged) -> str:
        """What to use, and on what data it was picked."""
        if chosen.selection is not None:
            return (
                f"**Use `{chosen.label}`**: on held-out data it picked `{chosen.selection['chosen']}` among "
                f"{len(chosen.selection.get('candidates', []))} candidates."
            )
        ranked = "under shift" if self.basis == "test" else "in distribution (no shift was given)"
        return (
            f"**Use `{chosen.label}`**: picked on the test data, the lowest NLL {ranked} among the rows within the "
            f"tolerance; {self.auto_hint} makes this choice on held-out data."
        )

    def _costs(self, chosen: Judged) -> str:
        """What it costs in distribution and at predict time."""
        clean = chosen.clean
        if not chosen.admissible:
            within = (
                f"; its {CONFIDENCE:.0%} bound {_signed(clean.upper)} is over the {self.tolerance:.4f}-nat tolerance "
                "on these test examples"
            )
        else:
            within = "" if clean.difference <= 0 else f"; within the {self.tolerance:.4f}-nat tolerance"
        change = f"{_relative(clean)}{within}".strip("; ")
        detail = f" ({change})" if change else ""
        if clean.difference < 0:
            text = f"It lowers the NLL in distribution by {-clean.difference:.4f} nats{detail}"
        elif clean.difference == 0:
            text = f"It leaves the NLL in distribution as it was{detail}"
        else:
            text = f"It costs {_signed(clean.difference)} nats of NLL in distribution{detail}"
        if chosen.predict_cost is None:
            return text + "."
        return f"{text}; a prediction costs {_predict(chosen)}."

    def _buys(self, chosen: Judged) -> str:
        """What it buys under shift and on OOD inputs."""
        if chosen.shifts:
            changes = list(chosen.shifts.items())
            low, high = min(changes, key=lambda item: item[1].difference), max(changes, key=lambda i: i[1].difference)
            span = (
                f"{_signed(low[1].difference)} nats of NLL under shift ({_relative(low[1], bare=True)}{_where(low[0])})"
                if low is high
                else f"{_signed(high[1].difference)} to {_signed(low[1].difference)} nats of NLL under shift "
                f"({_relative(high[1], bare=True)}{_where(high[0])} to {_relative(low[1], bare=True)}{_where(low[0])})"
            )
        else:
            span = self._held_out_shift(chosen)
        ood = (
            ""
            if chosen.ood is None
            else f" and {_signed(chosen.ood.difference, 3)} OOD AUROC ({chosen.ood.plain:.3f} -> {chosen.ood.value:.3f})"
        )
        return f"It buys {span}{ood}."

    def _held_out_shift(self, row: Judged) -> str:
        """Without test shifts: the change on auto's fit-time perturbed held-out copies, from its record."""
        record = row.selection
        chosen = _chosen_record(record) if record else None
        plain = (record or {}).get("plain", {}).get("shifted_nll")
        if chosen is None or chosen.get("shifted_nll") is None or not plain:
            return f"nothing measured under shift ({self.shift_hint} to see what it buys there)"
        value = chosen["shifted_nll"]
        ratio = f"{value / plain:.2f}x, " if abs(plain) >= RATIO_FLOOR else ""
        return (
            f"{_signed(value - plain)} nats of NLL on the {record.get('perturbed')} fit-time perturbed copies of the "
            f"held-out data ({ratio}no test shift was given: {self.shift_hint})"
        )

    def _keep_plain(self, chosen: Judged) -> list[str]:
        """The lines when nothing beats the plain model."""
        if chosen.selection is not None:
            return [
                f"**Keep the plain model**: `auto` found no candidate worth its cost on held-out data (it picked "
                f"`none` among {len(chosen.selection.get('candidates', []))} candidates)."
            ]
        lines = [
            "**Keep the plain model**: no method lowers the NLL under shift while its in-distribution excess stays "
            f"within {self.tolerance:.4f} nats at {CONFIDENCE:.0%} confidence."
            if self.basis == "test"
            else "**Keep the plain model**: no method lowers the in-distribution NLL, and no shift was given "
            f"({self.shift_hint} to see what it buys under shift)."
        ]
        best = self._contender()
        if best is not None and not best.admissible:
            plain_shift = self.row(self.plain).shift_nll
            buys = (
                f"{best.shift_nll / plain_shift:.2f}x"
                if abs(plain_shift) >= RATIO_FLOOR
                else f"{_signed(best.shift_nll - plain_shift)} nats"
            )
            lines.append(
                f"`{best.label}` would buy {buys} under shift but costs {_signed(best.clean.difference)} nats in "
                f"distribution (bound {_signed(best.clean.upper)})."
            )
        return lines

    def _contender(self) -> Judged | None:
        """The row other than the plain one with the lowest NLL under shift, when it is below the plain model's."""
        plain_shift = self.row(self.plain).shift_nll
        others = [row for row in self.rows if row.label != self.plain and row.shift_nll is not None]
        best = min(others, key=lambda row: row.shift_nll, default=None)
        return best if best is not None and plain_shift is not None and best.shift_nll < plain_shift else None

    # ---- the numbers -----------------------------------------------------------------------------------------------
    def compared(self) -> Judged | None:
        """The row the table sets against the plain model: the recommended one, or when the plain model is kept on the
        test data, the contender refused for its cost (``None``: nothing to compare)."""
        if self.recommended != self.plain:
            return self.row(self.recommended)
        return self._contender()

    def table(self) -> str:
        """The numbers of :meth:`lines`, each change with its paired interval ("" with nothing to compare)."""
        row = self.compared()
        if row is None:
            return ""
        lines = [
            f"| | `{self.plain}` (plain) | `{row.label}` | change [{self.ci:.0%} interval] | ratio |",
            "|---|---|---|---|---|",
            _nll_line("NLL in distribution", row.clean),
        ]
        lines += [_nll_line(f"NLL {_where(name)}", change) for name, change in row.shifts.items()]
        if not row.shifts and row.selection is not None:
            lines += self._held_out_lines(row)
        if row.ood is not None:
            lines.append(
                f"| OOD AUROC (entropy) | {row.ood.plain:.3f} | {row.ood.value:.3f} | {_signed(row.ood.difference, 3)} "
                f"{_interval(row.ood.interval, 3)} | – |"
            )
        if row.predict_cost is not None:  # the plain row's own measurement where it has one: one number per row
            measured = next((other.predict_cost for other in self.rows if other.label == self.plain), None)
            base = 1.0 if measured is None else measured
            plain, own = cost_cell(base, row.forward_seconds), cost_cell(row.predict_cost, row.forward_seconds)
            lines.append(f"| predict cost | {plain} | {own} | – | {_times(row.predict_cost / base)} |")
        return "\n".join(lines)

    def _held_out_lines(self, row: Judged) -> list[str]:
        """The held-out perturbed copies' NLL of the plain model and auto's pick (no interval: one value each)."""
        record = row.selection or {}
        chosen, plain = _chosen_record(record), record.get("plain", {}).get("shifted_nll")
        if chosen is None or chosen.get("shifted_nll") is None or not plain:
            return []
        value = chosen["shifted_nll"]
        ratio = f"{value / plain:.2f}x" if abs(plain) >= RATIO_FLOOR else "–"
        return [
            f"| NLL on {record.get('perturbed')} perturbed held-out copies | {plain:.4f} | {value:.4f} | "
            f"{_signed(value - plain)} | {ratio} |"
        ]

    def notes(self) -> list[str]:
        """One line each, after the table: what the shifts are, a ratio left out, a better candidate auto refused on
        held-out data (:func:`refused_better`), and a test table that disagrees with auto's pick."""
        notes = []
        row = self.compared()
        if row is not None and row.shifts and self.shift_note:
            notes.append(f"Shifts: {self.shift_note}.")
        changes = [] if row is None else [row.clean, *row.shifts.values()]
        if any(abs(change.plain) < RATIO_FLOOR for change in changes):
            notes.append(
                f"No ratio where the plain model's NLL is under {RATIO_FLOOR}: a ratio to a value that close to 0 "
                "says nothing; the difference does."
            )
        chosen = self.row(self.recommended)
        refused = refused_better(chosen.selection) if chosen.selection else None
        if refused is not None:
            notes.append(refused)
        left_out = left_out_note(chosen.selection) if chosen.selection else None
        if left_out is not None:
            notes.append(left_out)
        if self.disagreement is not None:
            label, change = self.disagreement
            against = "the plain model" if self.keeps_plain else f"`{self.recommended}`"
            notes.append(
                f"The test table disagrees: `{label}` has a lower test NLL than {against} by "
                f"{-change.difference:.4f} nats (paired {self.ci:.0%} interval of the change "
                f"{_interval(change.interval)}); auto chose on held-out data and never saw these test examples."
            )
        return notes

    # ---- Markdown and the frontier ---------------------------------------------------------------------------------
    def caption(self, frontier: bool = False) -> str:
        """What the numbers are, and with ``frontier`` what the frontier's points and bars are."""
        text = (
            f"Changes against the plain model `{self.plain}` with {self.ci:.0%} paired bootstrap intervals over the "
            f"{self.examples} test examples ({self.bootstraps} resamples)"
            + (
                "; predict cost: the median of repeated timings against a plain forward on the same inputs."
                if any(row.predict_cost is not None for row in self.rows)
                else "."
            )
        )
        if not frontier:
            return text
        return text + (
            f" Frontier: the plain model, the recommended row and the {FEATURED} others of lowest NLL under shift "
            f"(every row is in the tables), each its in-distribution NLL excess against its NLL under shift (mean "
            f"over the shifts), bars {FRONTIER_LEVEL:.0%} central intervals (an excess bar's right end is the "
            f"{CONFIDENCE:.0%} upper bound); shaded: admissible (bound within {self.tolerance:.4f} nats); hollow: "
            "refused; star: recommended."
        )

    def text(self) -> str:
        """The lines, the table and the notes, each block apart: what a terminal shows (``posthoc demo`` prints it)."""
        return "\n\n".join(part for part in [*self.lines(), self.table(), *self.notes()] if part)

    def markdown(self, frontier: str | None = None) -> str:
        """``## Verdict``, the lines, the table, the frontier image ``frontier`` (a file name, when drawn; an HTML page
        sets it beside the table), the notes and the caption."""
        parts = ["## Verdict", ""]
        for block in self.lines():
            parts += [block, ""]
        table = self.table()
        if table:
            parts += [table, ""]
        if frontier is not None:
            parts += [f"![frontier: in-distribution cost against NLL under shift]({frontier})", ""]
        for note in self.notes():
            parts += [note, ""]
        return "\n".join(parts + [self.caption(frontier is not None), ""])

    def featured(self, count: int = FEATURED) -> list[str]:
        """The rows a plot draws, in the rows' order: the plain one, the recommended one and the ``count`` others of
        lowest NLL under shift (without shifts: in distribution).

        Example:
            >>> from posthoc_apps.demo.examples import verdict
            >>> verdict.featured()
            ['none', 'laplace']
        """
        key = (lambda row: row.shift_nll) if self.shifts else (lambda row: row.clean.value)
        others = [
            row
            for row in self.rows
            if row.label not in (self.plain, self.recommended) and key(row) is not None and math.isfinite(key(row))
        ]
        picked = {self.plain, self.recommended, *(row.label for row in sorted(others, key=key)[:count])}
        return [row.label for row in self.rows if row.label in picked]

    def frontier_points(self, labels: Sequence[str] | None = None) -> list[FrontierPoint]:
        """The rows measured under shift as :class:`FrontierPoint` (test data): those of
        ``labels`` (default: :meth:`featured`)."""
        shown = set(self.featured() if labels is None else labels)
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
            if row.shift_nll is not None and row.label in shown
        ]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for metrics.json: the pick, its basis, the lines, the notes, and every row's changes."""

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
            "lines": self.lines(),
            "notes": self.notes(),
            "disagreement": None
            if self.disagreement is None
            else {"label": self.disagreement[0], "change": change(self.disagreement[1])},
            "rows": [
                {
                    "label": row.label,
                    "admissible": row.admissible,
                    "clean_nll": change(row.clean),
                    "shift_nll": row.shift_nll,
                    "shifts": {k: change(v) for k, v in row.shifts.items()},
                    "ood_auroc": change(row.ood),
                    "predict_cost": row.predict_cost,
                    "forward_seconds": row.forward_seconds,
                }
                for row in self.rows
            ],
        }


def left_out_note(selection: Mapping[str, Any]) -> str | None:
    """One line naming the candidates ``auto`` left out before it chose (``selection["left_out"]``: one that cannot
    run on this model, or the held-out data refused), each with its reason; ``None`` when there are none.

    Example:
        >>> from posthoc.evaluation.verdict import left_out_note
        >>> print(left_out_note({"left_out": {"laplace": "a head with 1 output; give it two"}}))
        Left out by auto before it chose: `laplace` (a head with 1 output; give it two).
    """
    left_out = selection.get("left_out") or {}
    if not left_out:
        return None
    named = "; ".join(f"`{label}` ({reason.rstrip('.')})" for label, reason in left_out.items())
    return f"Left out by auto before it chose: {named}."


def refused_better(selection: Mapping[str, Any]) -> str | None:
    """One line naming the candidate a selection record (``um.summary()["selection"]``) refused although its held-out
    mean NLL was lower than the chosen one's: its gain, its bound, and the ``tolerance=`` that would take it (a
    candidate is admitted when its bound is at most the tolerance); ``None`` when no refused candidate was better.

    Example:
        >>> from posthoc.evaluation.verdict import refused_better
        >>> record = {"chosen": "none", "tolerance": 0.005, "candidates": [
        ...     {"candidate": "none", "excess": 0.0, "bound": 0.0, "admissible": True, "chosen": True},
        ...     {"candidate": "laplace", "excess": -0.034, "bound": 0.0052, "admissible": False, "chosen": False}]}
        >>> print(refused_better(record))
        Refused on held-out data although better there: `laplace`, held-out NLL 0.0340 nats below the plain ...
        >>> refused_better(record).split("; ")[-1]      # admitted when its bound <= the tolerance
        '`fit(..., tolerance=0.0052)` would take it.'
    """
    candidates = [row for row in selection.get("candidates", []) if isinstance(row, Mapping)]
    chosen = _chosen_record(selection)
    chosen_excess = 0.0 if chosen is None or not _finite(chosen.get("excess")) else float(chosen["excess"])
    tolerance = float(selection.get("tolerance", math.nan))
    refused = [
        row
        for row in candidates
        if not row.get("admissible")
        and not row.get("chosen")
        and _finite(row.get("excess"))
        and _finite(row.get("bound"))
        and float(row["excess"]) < chosen_excess
        and not float(row["bound"]) <= tolerance
    ]
    if not refused:
        return None
    best = min(refused, key=lambda row: float(row["excess"]))
    gain, bound = -float(best["excess"]), float(best["bound"])
    name = selection.get("chosen") if chosen is None else chosen.get("candidate")
    beyond = "" if chosen_excess == 0 else f" ({chosen_excess + gain:.4f} below the chosen `{name}`'s)"
    return (
        f"Refused on held-out data although better there: `{best['candidate']}`, held-out NLL {gain:.4f} nats below "
        f"the plain model's{beyond}, but its {float(best.get('confidence', CONFIDENCE)):.0%} bound {_signed(bound)} "
        "is over the tolerance "
        f"{tolerance:.4f}; `fit(..., tolerance={_rounded_up(bound)})` would take it."
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rounded_up(value: float, digits: int = 2) -> str:
    """``value`` rounded up to ``digits`` significant digits, printed so that it reads back at least ``value``.

    Example:
        >>> from posthoc.evaluation.verdict import _rounded_up
        >>> _rounded_up(0.00523), _rounded_up(0.0052), _rounded_up(0.1204)
        ('0.0053', '0.0052', '0.13')
    """
    if value <= 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(value)))
    step = 10.0**-decimals
    up = math.ceil(round(value / step, 9)) * step
    text = f"{up:.{decimals}f}"
    return text if float(text) >= value else f"{up + step:.{decimals}f}"


def _relative(change: Change, *, bare: bool = False) -> str:
    """``0.89x the plain model's 0.6001`` (``bare``: ``0.89x ``), or "" where the plain value is under
    :data:`RATIO_FLOOR` (a ratio to nearly 0 says nothing)."""
    if abs(change.plain) < RATIO_FLOOR:
        return ""
    return f"{change.ratio:.2f}x " if bare else f"{change.ratio:.2f}x the plain model's {change.plain:.4f}"


def _nll_line(name: str, change: Change) -> str:
    """A table line of an NLL change: plain, row, change with its interval, and the ratio (``–`` near zero)."""
    ratio = f"{change.ratio:.2f}x" if abs(change.plain) >= RATIO_FLOOR else "–"
    return (
        f"| {name} | {change.plain:.4f} | {change.value:.4f} | {_signed(change.difference)} "
        f"{_interval(change.interval)} | {ratio} |"
    )


def _times(ratio: float) -> str:
    """``2.3x``, ``101.2x``, ``2,314x``."""
    return f"{ratio:,.0f}x" if ratio >= 1000 else f"{ratio:.1f}x"


def _microseconds(seconds: float) -> str:
    """``46 µs`` / ``2.5 µs`` / ``1,204 µs``."""
    value = seconds * 1e6
    return f"{value:,.1f} µs" if value < 10 else f"{value:,.0f} µs"


def cost_cell(ratio: float | None, forward_seconds: float | None = None) -> str:
    """A predict cost as a ratio to a plain forward, with its time per call in microseconds when a plain forward
    takes under :data:`MICROSECONDS_BELOW` (where a ratio alone reads as thousands of x on a fast model); ``–``
    when not measured.

    Example:
        >>> from posthoc.evaluation.verdict import cost_cell
        >>> cost_cell(2314.0, 8e-7), cost_cell(1.4, 0.02), cost_cell(None)
        ('2,314x (1,851 µs)', '1.4x', '–')
    """
    if ratio is None:
        return "–"
    text = _times(ratio)
    if forward_seconds is not None and 0 < forward_seconds < MICROSECONDS_BELOW:
        text += f" ({_microseconds(ratio * forward_seconds)})"
    return text


def _predict(row: Judged) -> str:
    """What a prediction costs, in the words of the cost line."""
    if row.predict_cost is None:
        return "an unmeasured time"
    text = f"{_times(row.predict_cost)} a plain forward"
    seconds = row.forward_seconds
    if seconds is not None and 0 < seconds < MICROSECONDS_BELOW:
        text += f" ({_microseconds(row.predict_cost * seconds)} against {_microseconds(seconds)})"
    return text


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

    ``tolerance``: nats per example (default: :class:`~posthoc.engine.selection.Tolerance`); ``auto_hint`` and
    ``shift_hint`` say, in the caller's terms, how to choose on held-out data and how to add a shift; ``shift_note``
    says what the shifts are.
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
    disagreement = None
    if basis == "auto":
        pick = candidates[labels.index(recommended)]
        disagreement = disagreeing_row(candidates, pick, resamples(len(pick.clean)), ci)
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
        disagreement,
    )


def disagreeing_row(
    candidates: Sequence[Candidate], pick: Candidate, index: Tensor, ci: float = CI
) -> tuple[str, Change] | None:
    """The row of lowest test NLL among those clearly below ``pick``'s (paired ``ci`` interval below 0), with its
    change against ``pick``; ``None`` when none is.

    Example:
        >>> import torch
        >>> from posthoc.evaluation import bootstrap
        >>> from posthoc.evaluation.verdict import Candidate, disagreeing_row
        >>> plain = torch.full((200,), 0.5, dtype=torch.float64)
        >>> rows = [Candidate("auto", plain), Candidate("laplace", plain * 0.5 + 0.01 * torch.rand(200))]
        >>> label, change = disagreeing_row(rows, rows[0], bootstrap.resample_index(200, 200))
        >>> label, round(change.difference, 2), change.interval[1] < 0
        ('laplace', -0.25, True)
    """
    found = []
    for row in candidates:
        if row.label == pick.label:
            continue
        change = paired_change(row.clean, pick.clean, index, ci)
        if change.interval[1] < 0:
            found.append((row.label, change))
    return min(found, key=lambda item: item[1].difference, default=None)


def selection_points(selection: Mapping[str, Any]) -> list[FrontierPoint]:
    """The candidates of a selection record as frontier points on held-out data (the excess with a bar up to its
    one-sided bound, the NLL on the perturbed copies); candidates with the same numbers are one point named after all.

    Example:
        >>> from posthoc_apps.report import plots
        >>> from posthoc.evaluation.verdict import selection_points
        >>> from posthoc_apps.demo.examples import um
        >>> points = selection_points(um.summary()["selection"])
        >>> len(points), points[0].label, points[-1].label    # laplace's prior precisions
        (23, '1e+08', '2.51')
        >>> fig = plots.frontier(points, "selection.png", tolerance=um.summary()["selection"]["tolerance"])
    """
    z = NormalDist().inv_cdf(CONFIDENCE)
    found: dict[tuple, FrontierPoint] = {}
    for row in selection.get("candidates", []):
        x, bound, y = row.get("excess"), row.get("bound"), row.get("shifted_nll")
        if x is None or bound is None or y is None or not all(math.isfinite(v) for v in (x, bound, y)):
            continue
        spread = row.get("shifted_nll_se")
        key = (x, bound, y, spread)
        point = FrontierPoint(
            str(row["candidate"]),
            x,
            (x - (bound - x), bound),
            y,
            None if spread is None else (y - z * spread, y + z * spread),
            bool(row.get("admissible")),
            bool(row.get("chosen")),
        )
        same = found.get(key)
        found[key] = (
            point
            if same is None
            else replace(
                same,
                label=f"{same.label} = {point.label}",
                admissible=same.admissible or point.admissible,
                chosen=same.chosen or point.chosen,
            )
        )
    return list(found.values())
