"""A re-export of :class:`~posthoc.guarantees.conformal.ConformalRegressor`, kept only for the evaluation modules being merged."""

from posthoc.guarantees.conformal import ConformalRegressor  # noqa: F401
