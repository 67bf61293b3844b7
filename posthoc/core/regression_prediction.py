"""A re-export of :mod:`posthoc.core.prediction`'s regression names, kept only for the evaluation modules being merged."""

from posthoc.core.prediction import COMPONENTS, RegressionPrediction, concat, mix_predictions  # noqa: F401
