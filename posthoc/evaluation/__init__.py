"""Measuring a predictive: metrics, the :class:`Report` and its pictures."""
