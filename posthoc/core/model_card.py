""":class:`ModelCard`: what a posterior is over, as a dict of plain Python values and as Markdown (``um.summary()``)."""

from __future__ import annotations

import math
from typing import Any

from posthoc.core.fit_record import FitRecord
from posthoc.core.rendering import markdown_html

#: list values longer than this show their first entries and how many there are in all
SHOWN_ITEMS = 8
#: the key under which a method that chooses a chain (``method="auto"``) lists the chosen methods' own cards
NESTED = "chosen_posterior"


class ModelCard(dict):
    """The card of an :class:`~posthoc.engine.uncertain_model.UncertainModel`; build it with :meth:`of`.

    Keys: ``methods`` (inner first), ``fitted``, ``random_variables`` (summed; ``None`` while a method cannot tell
    yet), ``posterior`` (per method: ``method``, ``options``, ``fitted`` and its ``Method.summary()``),
    ``train_examples`` / ``val_examples`` / ``fit_wall_seconds`` / ``fit_cpu_seconds`` (``None`` when not recorded),
    ``model_class``, ``fingerprint``, ``posthoc_version`` and ``selection`` (the outermost held-out choice's record).

    Example:
        >>> from posthoc.core.model_card import ModelCard
        >>> ModelCard.of([{"method": "none", "options": {}, "fitted": True, "random_variables": 0, "layers": []}],
        ...              None, model_class="Net", fingerprint="ab12", version="0.1.0")["random_variables"]
        0
    """

    @classmethod
    def of(
        cls,
        posterior: list[dict[str, Any]],
        fit: FitRecord | None,
        *,
        model_class: str,
        fingerprint: str | None,
        version: str,
    ) -> ModelCard:
        """The card of a chain of methods described by ``posterior`` (inner first), fitted as ``fit`` tells."""
        counts = [entry.get("random_variables") for entry in posterior]
        selection = next((entry["selection"] for entry in reversed(posterior) if entry.get("selection")), None)
        return cls(
            methods=[entry["method"] for entry in posterior],
            fitted=all(entry["fitted"] for entry in posterior),
            random_variables=None if None in counts else sum(counts),
            posterior=posterior,
            train_examples=None if fit is None else fit.train_examples,
            val_examples=None if fit is None else fit.val_examples,
            fit_wall_seconds=None if fit is None else fit.wall_seconds,
            fit_cpu_seconds=None if fit is None else fit.cpu_seconds,
            model_class=model_class,
            fingerprint=fingerprint,
            posthoc_version=version,
            selection=selection,
        )

    def to_markdown(self) -> str:
        """The card as Markdown: a table of the model-level keys, then a table per method.

        Example:
            >>> from posthoc_apps.demo.examples import um
            >>> print(um.summary().to_markdown().splitlines()[0])
            # Model card: laplace
        """
        lines = [f"# Model card: {' + '.join(self['methods'])}", ""]
        if self.get("selection"):
            lines += [choice_line(self["selection"]), ""]
        lines += _table({key: value for key, value in self.items() if key not in ("posterior", "selection")})
        for position, entry in enumerate(self["posterior"], start=1):
            lines += ["", f"## {position}. {entry['method']}", ""]
            details = {f"options.{key}": value for key, value in entry["options"].items()}
            details.update(
                (key, value) for key, value in entry.items() if key not in ("method", "options", "selection", NESTED)
            )
            lines += _table(details)
            if entry.get("selection"):
                lines += ["", *selection_table(entry["selection"])]
            lines += _nested_cards(entry.get(NESTED), str(position))
        return "\n".join(lines) + "\n"

    def _repr_markdown_(self) -> str:
        """A notebook's view of ``um.summary()``: :meth:`to_markdown`."""
        return self.to_markdown()

    def _repr_html_(self) -> str:
        """A notebook's view of ``um.summary()``: :meth:`to_markdown` as HTML (its tables as tables)."""
        return markdown_html(self.to_markdown())


def choice_line(selection: dict[str, Any]) -> str:
    """One sentence of a held-out choice's record: what was chosen, and its held-out NLL beside the plain model's
    (``none``), the baseline every candidate is judged against.

    Example:
        >>> import posthoc
        >>> from posthoc.core.model_card import choice_line
        >>> from posthoc_apps.demo.examples import model, val_loader
        >>> um = posthoc.wrap(model, method="temperature").fit(val_loader=val_loader, progress=False)
        >>> choice_line(um.summary()["selection"]).split(",")[0]
        'Chosen calibration: **clean fit at 0.75**'
    """
    plain = selection["plain"]["clean_nll"]
    row = next((row for row in selection["candidates"] if row.get("chosen")), None)
    excess = None if row is None else row.get("excess")
    chosen = "-" if excess is None or plain is None else _shown(plain + excess)
    return (
        f"Chosen {selection['knob']}: **{selection['chosen']}**, held-out NLL {chosen} against the plain model's "
        f"(`none`, the baseline) {_shown(plain)} on {selection['examples']} examples."
    )


def _nested_cards(cards: list[dict[str, Any]] | None, position: str) -> list[str]:
    """The chain a method chose (``method="auto"``'s ``chosen_posterior``), one subsection per method."""
    lines = []
    for number, card in enumerate(cards or [], start=1):
        lines += ["", f"### {position}.{number} {card.get('method', '?')} (in the chosen chain)", ""]
        lines += _table({key: value for key, value in card.items() if key not in ("method", "selection")})
        if card.get("selection"):
            lines += ["", *selection_table(card["selection"])]
    return lines


def selection_table(selection: dict[str, Any]) -> list[str]:
    """A held-out choice's record (``Selection.to_dict()``) as Markdown lines: the rule, then one row per candidate.

    Example:
        >>> import posthoc
        >>> from posthoc.core.model_card import selection_table
        >>> from posthoc_apps.demo.examples import model, val_loader
        >>> um = posthoc.wrap(model, method="temperature").fit(val_loader=val_loader, progress=False)
        >>> print(selection_table(um.summary()["selection"])[0])
        Held-out choice of the calibration: **clean fit at 0.75**. Admissible: the 95% (90% for a gain beyond the...
    """
    plain = selection["plain"]
    gain = selection.get("gain_confidence")
    levels = f"{selection['confidence']:.0%}" + (f" ({gain:.0%} for a gain beyond the tolerance)" if gain else "")
    lines = [
        f"Held-out choice of the {selection['knob']}: **{selection['chosen']}**. Admissible: the "
        f"{levels} upper bound of the NLL excess over the plain model (NLL "
        f"{_shown(plain['clean_nll'])}) on {selection['examples']} held-out examples at most "
        f"{_shown(selection['tolerance'])} nats"
        + (f"; {selection['folds']}-fold cross-fitted" if selection.get("folds") else "")
        + (
            f"; then the lowest NLL on {selection['perturbed']} perturbed copies (plain: "
            f"{_shown(plain['shifted_nll'])})"
            if selection.get("perturbed")
            else ""
        )
        + ".",
        "",
    ]
    header = _selection_header(selection["candidates"])
    lines += header
    columns = header[0].count("|") - 1
    for group in _untried_runs(selection["candidates"]):
        row = group[0]
        if len(group) > 1:
            name = f"{_shown(row['candidate'])} ... {_shown(group[-1]['candidate'])} ({len(group)} candidates)"
            lines.append(f"| {_cell(name)} |" + " - |" * (columns - 2) + f" {_cell(row['reason'])} |")
            continue
        verdict = (
            "**chosen**" if row["chosen"] else ("admissible" if row["admissible"] else (row["reason"] or "refused"))
        )
        costs = [_shown(row.get("fit_seconds", row["seconds"]))]
        if "predict_cost" in row:
            costs.append("-" if row["predict_cost"] is None else f"{_shown(row['predict_cost'])}x")
        lines.append(
            f"| {_cell(str(row['candidate']))} | {_shown(row['excess'])} ({_shown(row['bound'])}) | "
            f"{_shown(row['shifted_nll'])} | {_shown(row['shifted_ece'])} | " + " | ".join(costs) + " | "
            f"{_cell(verdict)} |"
        )
    untried = selection.get("not_tried")
    if untried:
        name = f"{_shown(untried['from'])} ... {_shown(untried['to'])} ({untried['count']} candidates)"
        lines.append(f"| {_cell(name)} |" + " - |" * (columns - 2) + f" {_cell(untried['reason'])} |")
    for label, reason in (selection.get("left_out") or {}).items():
        lines.append(f"| {_cell(label)} |" + " - |" * (columns - 2) + f" {_cell('left out: ' + reason)} |")
    return lines


def _untried_runs(candidates: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The candidates in order, each alone, except that a run not tried for the same reason is one group (one line)."""
    groups: list[list[dict[str, Any]]] = []
    for row in candidates:
        untried = not row["admissible"] and str(row.get("reason") or "").startswith("not tried")
        previous = groups[-1][-1] if groups else None
        same_reason = (
            previous is not None and previous.get("reason") == row.get("reason") and not previous["admissible"]
        )
        if untried and same_reason:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _selection_header(candidates: list[dict[str, Any]]) -> list[str]:
    """The header of :func:`selection_table`: a method's fit seconds and predict cost where recorded, else seconds."""
    costs = [
        "fit s" if candidates and "fit_seconds" in candidates[0] else "seconds",
        *(["predict x fwd"] if candidates and "predict_cost" in candidates[0] else []),
    ]
    header = ["candidate", "excess (bound)", "perturbed NLL", "perturbed ECE", *costs, "verdict"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def _table(values: dict[str, Any]) -> list[str]:
    rows = ["| key | value |", "|---|---|"]
    return rows + [f"| {_cell(key)} | {_cell(_shown(value))} |" for key, value in values.items()]


def _shown(value: Any) -> str:
    """A value as a short string: 4 significant digits for floats, long lists cut after :data:`SHOWN_ITEMS`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_shown(item) for item in value[:SHOWN_ITEMS])
        return f"{shown}, ... ({len(value)} in all)" if len(value) > SHOWN_ITEMS else (shown or "(none)")
    if isinstance(value, dict):
        return ", ".join(f"{key}={_shown(item)}" for key, item in value.items()) or "(none)"
    return str(value)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
