"""The spread of IVON's samples chosen on held-out data: the scales of its standard deviations that are tried.

A short fine-tune is far too short for IVON's Hessian estimate to move from ``hess_init``, so the posterior's width is
set mostly by a number with no meaning for the user's model. As SWAG's scale is, it is then chosen on ``val_loader``:
sample ``s`` is ``m + scale * std * z_s``, ``scale`` chosen among 0 (the fine-tuned mean) and :data:`SCALES` by the
selection step, walking down from the widest until one is admissible.

Example:
    >>> from posthoc.methods.ivon.scale import SCALES
    >>> max(SCALES), min(SCALES)
    (4.0, 0.0625)
"""

from __future__ import annotations

#: the scales tried, widest first (factors of 2 around IVON's own posterior, 1)
SCALES = (4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625)
