"""A method's held-out knob, declared once: :class:`Knob`.

A held-out choice picks one value of a knob (a prior precision, a rate, a scale) on validation data. The method says
what the knob is called, its candidates, how one is scored and applied; the runner
(:func:`posthoc.engine.choice.make_choice`) scores them through the selection step and applies the chosen value.

Example:
    >>> from posthoc.core.knob import Knob
    >>> knob = Knob(name="scale", candidates=[("0", 0.0), ("1", 1.0)], score=lambda value, held_out: None, apply=print)
    >>> knob.values(), knob.start_index()
    ([0.0, 1.0], 0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: ``(label, value)`` of one candidate, as the selection step takes it
Candidate = tuple[str, Any]


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One held-out choice of a method (module docs); :meth:`posthoc.core.method.Method.knob` returns it.

    Attributes:
        name: what is chosen, for the record (``"prior_precision"``, ``"dropout rate"``).
        candidates: ``(label, value)`` pairs from the narrowest spread (the most conservative) to the widest.
        score: ``score(value, held_out)``, the :class:`~posthoc.engine.selection.Scores` at one candidate value.
        prepare: ``prepare(held_out, train_loader)``, the held-out data prepared once for every ``score``.
        apply: sets one candidate value at once.
        start: the value the walk of the selection step starts from (``None``: the first).
        movable: whether :attr:`apply` sets another candidate without a refit (so cross-fitting re-makes the choice).
        fallback: ``(who, what the first candidate keeps, advice)`` for the warning when nothing is admissible.
        then: ``then(selection, held_out, train_loader, progress)``, the work that follows the applied choice.
        choose: ``choose(held_out, train_loader, progress)`` for a choice that is not a walk over fixed candidates,
            returning the selection to record or ``None`` (``score``, ``prepare``, ``start`` etc. are then unused).
        training_rows: ``training_rows(train_loader)``, the rows to choose on without a ``val_loader`` (or ``None``).
    """

    name: str
    candidates: Sequence[Candidate] = ()
    score: Callable[[Any, Any], Any] | None = None
    prepare: Callable[[Any, Iterable | None], Any] | None = None
    apply: Callable[[Any], Any] | None = None
    start: Any = None
    movable: bool = False
    fallback: tuple[str, str, str] | None = None
    then: Callable[[Any, Any, Iterable | None, bool], None] | None = None
    choose: Callable[[Any, Iterable | None, bool], Any] | None = None
    training_rows: Callable[[Iterable | None], Iterable | None] | None = None

    def values(self) -> list[Any]:
        """The candidate values, in order."""
        return [value for _, value in self.candidates]

    def start_index(self) -> int:
        """The index of :attr:`start` among the candidates (0 without one)."""
        return 0 if self.start is None else self.values().index(self.start)
