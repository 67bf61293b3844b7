"""``"auto"``: the method chosen on held-out data among candidates; see :mod:`posthoc.methods.auto.method`."""

from posthoc.methods.auto.method import AutoMethod

__all__ = ["AutoMethod"]
