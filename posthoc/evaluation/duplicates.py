"""Rows that say the same thing: the rows of a comparison whose predictions are the same are merged, with a note.

A calibrator that kept T = 1 on top of a method, or two configurations that made the same held-out choice, predict the
same on every example: their rows only make the tables longer. :func:`merge_identical` finds them (within
:data:`ATOL`) and keeps the first of each group (or the plain model, the recommended row); :func:`merge_note` says
what was merged into what, and why.

Example:
    >>> import torch
    >>> from posthoc.evaluation.duplicates import merge_identical, merge_note
    >>> from posthoc_apps.demo.examples import probs
    >>> other = torch.softmax(torch.log(probs) / 2, -1)
    >>> rows = {"MAP": [probs], "temperature": [probs.clone()], "laplace": [other], "laplace (again)": [other]}
    >>> merged = merge_identical(rows, why=lambda label, into: "its temperature kept T = 1" if label == "temperature"
    ...                          else "the same choice made twice")
    >>> [(m.label, m.into) for m in merged]
    [('temperature', 'MAP'), ('laplace (again)', 'laplace')]
    >>> print(merge_note(merged))
    Merged rows (the same predictions, within 1e-06, on every example): `temperature` into `MAP` (its temperature ...
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: the largest difference between two rows' predictions (probabilities, scores) that still counts as the same
ATOL = 1e-6
#: why two rows are the same, when the caller does not say
SAME = "the same predictions"


@dataclass(frozen=True)
class Merged:
    """Row ``label`` merged into row ``into``, and ``why`` they are the same (e.g. ``"its temperature kept T = 1"``)."""

    label: str
    into: str
    why: str = SAME


def same_predictions(first: Sequence[Tensor | None], second: Sequence[Tensor | None], atol: float = ATOL) -> bool:
    """Whether two rows' predictions, compared in order, are the same within ``atol`` (``None`` only matches ``None``).

    Example:
        >>> from posthoc.evaluation.duplicates import same_predictions
        >>> from posthoc_apps.demo.examples import probs
        >>> same_predictions([probs, None], [probs + 1e-9, None]), same_predictions([probs], [probs.flip(-1)])
        (True, False)
    """
    if len(first) != len(second):
        return False
    for a, b in zip(first, second):
        if a is None or b is None:
            if a is not b:
                return False
            continue
        if a.shape != b.shape or not torch.allclose(a.double().cpu(), b.double().cpu(), rtol=0, atol=atol):
            return False
    return True


def merge_identical(
    rows: Mapping[str, Sequence[Tensor | None]],
    *,
    keep: Collection[str] = (),
    why: Callable[[str, str], str] | None = None,
    atol: float = ATOL,
) -> list[Merged]:
    """Which rows merge into which: ``rows`` maps each row's label to its predictions; a row the same as an earlier
    one merges into it, but the rows of ``keep`` are never merged away. ``why(label, into)`` says why.

    Example:
        >>> from posthoc.evaluation.duplicates import merge_identical
        >>> from posthoc_apps.demo.examples import probs
        >>> merge_identical({"MAP": [probs], "auto": [probs.clone()]}, keep=["auto"])
        [Merged(label='MAP', into='auto', why='the same predictions')]
    """
    order = sorted(rows, key=lambda label: (label not in keep, list(rows).index(label)))
    kept: list[str] = []
    merged: dict[str, str] = {}
    for label in order:
        into = next((other for other in kept if same_predictions(rows[label], rows[other], atol)), None)
        if into is None or (label in keep and into in keep):
            kept.append(label)
        else:
            merged[label] = into
    return [Merged(label, into, SAME if why is None else why(label, into)) for label, into in merged.items()]


def merge_note(merged: Sequence[Merged], atol: float = ATOL) -> str:
    """One line saying which rows were merged into which, and why ("" when none was)."""
    if not merged:
        return ""
    parts = [f"`{m.label}` into `{m.into}` ({m.why})" for m in merged]
    return f"Merged rows (the same predictions, within {atol:g}, on every example): " + "; ".join(parts) + "."


def without(items: Sequence, merged: Sequence[Merged], label: Callable[[object], str]) -> list:
    """``items`` without those whose ``label(item)`` was merged away (in their order).

    Example:
        >>> from posthoc.evaluation.duplicates import Merged, without
        >>> without(["MAP", "temperature", "laplace"], [Merged("temperature", "MAP")], str)
        ['MAP', 'laplace']
    """
    gone = {m.label for m in merged}
    return [item for item in items if label(item) not in gone]
