"""The spread of IVON's samples chosen on held-out data: the widest scale of its standard deviations within tolerance.

Why: a short fine-tune from a checkpoint is far too short for IVON's Hessian estimate ``h`` to
converge from ``hess_init`` (its running average keeps about ``beta2^steps`` of the start), so the
posterior's width is set mostly by ``hess_init``, a number with no meaning for the user's model.
As SWAG's scale and Laplace's prior precision are, the spread is then chosen on ``val_loader``:
sample ``s`` is ``m + scale * std * z_s`` (``scale^2`` is a posterior temperature), with ``scale``
the largest of :data:`SCALES` whose held-out NLL stays within ``(1 + tolerance)`` of the
checkpoint's, or 0 (the fine-tuned mean alone) with a warning when none does.

Example:
    >>> widest_scale(lambda s: 0.10 * (1 + 0.004 * s), plain_nll=0.10, tolerance=0.01)
    2.0
"""

from __future__ import annotations

from collections.abc import Callable

from posthoc.engine.held_out import widest_spread

#: the scales tried, widest first (factors of 2 around IVON's own posterior, 1)
SCALES = (4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625)


def widest_scale(validation_nll: Callable[[float], float], *, plain_nll: float, tolerance: float,
                 limit: float | None = None) -> float:
    """The widest scale of :data:`SCALES` whose ``validation_nll`` is within ``(1 + tolerance) * plain_nll``, else 0.

    ``limit``, where given, is the NLL still within (:func:`posthoc.engine.objective.nll_limit`). The walk (:func:`posthoc.engine.held_out.widest_spread`) starts at the widest scale and goes down
    until one is within."""
    ladder = sorted(SCALES)
    limit = (1 + tolerance) * plain_nll if limit is None else limit
    return widest_spread(ladder, lambda scale: validation_nll(scale) <= limit,
                         start=len(ladder) - 1, method="IVON", tolerance=tolerance, over="the checkpoint",
                         fallback="the fine-tuned mean", advice="Raise val_tolerance, fit longer, or pass a fixed scale")
