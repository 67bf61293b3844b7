"""Dataset shift on the fly: ``posthoc.shift.corrupt(loader, kind, severity)`` (ImageNet-C style corruptions).

Example:
    >>> noisy = posthoc.shift.corrupt(test_loader, "gaussian-noise", 3)
    >>> posthoc.shift.KINDS[:3]
    ('gaussian-noise', 'shot-noise', 'salt-pepper')
"""

from posthoc.shift.kinds import EVALUATION_KINDS, KINDS, SEVERITIES
from posthoc.shift.loader import CorruptedLoader, corrupt, corrupt_images

__all__ = ["corrupt", "corrupt_images", "CorruptedLoader", "KINDS", "EVALUATION_KINDS", "SEVERITIES"]
