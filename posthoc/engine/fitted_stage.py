"""A stacked method fitted on held-out predictions: its fit is a held-out choice among configurations, cross-fitted.

A calibrator or DAC fits its parameters on the inner predictive's outputs over the validation batches; which
configuration to fit (none, a clean fit, a fit pulled towards the perturbed copies) is a held-out choice, with
cross-fitted scores (:mod:`posthoc.engine.selection`). A subclass says what it caches, which configurations it tries,
how one is fitted and scored on given rows, and how the chosen one is applied; :meth:`FittedOnHeldOut.knob` does the rest.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, val_loader
    >>> um = posthoc.wrap(model, method="temperature").fit(val_loader=val_loader)
    >>> um.summary()["selection"]["folds"]
    5
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from posthoc.core.knob import Knob
from posthoc.engine.choice import movable
from posthoc.engine.held_out import HeldOut
from posthoc.engine.selection import Candidate, Rows, Scores, Selection, choice_on, cross_fitted, fold_count


class FittedOnHeldOut:
    """Mixin of a :class:`~posthoc.core.method.Method` whose held-out choice is among configurations fitted on
    held-out predictions (module docs). ``knob_name`` names the choice in its record."""

    knob_name: ClassVar[str] = "configuration"

    def held_out_cache(self, held_out: HeldOut) -> Any:
        """What every configuration is fitted and scored on: the inner predictions (and more) over the clean and the
        perturbed held-out batches, indexable by :class:`~posthoc.engine.selection.Rows`."""
        raise NotImplementedError

    def configurations(self, cache: Any) -> list[Candidate]:
        """``(label, value)`` of the configurations tried, the most conservative first (no change to the inner one)."""
        raise NotImplementedError

    def fit_and_score(
        self, cache: Any, configurations: list[Candidate], fitting: Rows, scored: Rows
    ) -> list[Scores | None]:
        """Every configuration fitted on ``fitting`` and scored on ``scored`` (``None``: it cannot be fitted there)."""
        raise NotImplementedError

    def apply(self, cache: Any, value: Any, held_out: HeldOut) -> None:
        """Fit configuration ``value`` on all the held-out rows and keep it."""
        raise NotImplementedError

    def cross_fitted_selection(self, cache: Any, held_out: HeldOut, configurations: list[Candidate]) -> Selection:
        """The selection among ``configurations`` by their out-of-fold scores (fold warnings silenced: the final fit warns).

        A movable held-out choice of the inner method is re-made on each fold's fitting examples
        (:func:`~posthoc.engine.selection.choice_on`): tuned on every held-out example, it would make the stacked
        candidates look cheaper than they are on new data.
        """
        folds = fold_count(held_out.layout)
        caches = self._fold_caches(cache, held_out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            scores = cross_fitted(
                lambda fitting, scored: self.fit_and_score(caches(scored), configurations, fitting, scored),
                held_out.layout,
            )
        return held_out.select(configurations, scores, knob=self.knob_name, folds=folds if folds > 1 else None)

    def _fold_caches(self, cache: Any, held_out: HeldOut) -> Any:
        """``scored rows -> cache`` of each fold: the inner predictive at the choice re-made without those rows."""
        inner = getattr(self, "inner", None)
        selection = None if inner is None else inner.last_selection
        if (
            selection is None
            or not movable(inner)
            or selection.plain_scores is None
            or len(selection.plain_scores.clean) != held_out.layout.count
        ):
            return lambda scored: cache
        chosen = selection.index
        by_fold, made = [], {chosen: cache}
        for fitting, scored in held_out.layout.folds():
            index = choice_on(selection, selection.plain_scores, fitting)
            if index not in made:
                inner.knob().apply(selection.records[index].value)
                try:
                    made[index] = self.held_out_cache(held_out)
                finally:
                    inner.knob().apply(selection.records[chosen].value)
            by_fold.append((scored.clean, made[index]))

        def of(scored: Rows) -> Any:
            return next(found for rows, found in by_fold if torch.equal(rows, scored.clean))

        return of

    def knob(self) -> Knob:
        """The configuration, cross-fitted: its own ``choose``, since every candidate is fitted on the held-out data."""
        return Knob(name=self.knob_name, choose=self._choose_configuration)

    def _choose_configuration(self, held_out: HeldOut, train_loader: Iterable | None, progress: bool) -> Selection:
        """Cache the held-out predictions, choose a configuration by its cross-fitted scores, and fit it on all rows."""
        cache = self.held_out_cache(held_out)
        selection = self.cross_fitted_selection(cache, held_out, self.configurations(cache))
        self.apply(cache, selection.value, held_out)
        return selection
