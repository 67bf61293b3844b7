"""Dataset shift: ``posthoc.shift.corrupt(loader, kind, severity)`` (ImageNet-C style corruptions of images) and,
for tabular or 1-D inputs, ``extrapolation_split`` / ``gap_split`` (rows held out by one feature's range).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import test_loader, x, y
    >>> noisy = posthoc.shift.corrupt(test_loader, "gaussian-noise", 3)
    >>> posthoc.shift.KINDS[:3]
    ('gaussian-noise', 'shot-noise', 'salt-pepper')
    >>> fit, heavy = posthoc.shift.extrapolation_split(x, y, feature=3, quantile=0.7)
"""

from posthoc.shift.features import ShiftSplit, extrapolation_split, gap_split
from posthoc.shift.kinds import EVALUATION_KINDS, KINDS, SEVERITIES
from posthoc.shift.loader import CorruptedLoader, corrupt, corrupt_images

__all__ = [
    "corrupt",
    "corrupt_images",
    "CorruptedLoader",
    "KINDS",
    "EVALUATION_KINDS",
    "SEVERITIES",
    "extrapolation_split",
    "gap_split",
    "ShiftSplit",
]
