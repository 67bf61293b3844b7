"""``"tta"``: test-time augmentation stacked on any method; see :mod:`posthoc.methods.tta.method`."""

from posthoc.methods.tta.method import TestTimeAugmentation

__all__ = ["TestTimeAugmentation"]
