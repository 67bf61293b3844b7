"""``"abnn"``: Adaptable Bayesian Neural Network, "Make me a BNN" (:mod:`posthoc.methods.abnn.method`)."""

from posthoc.methods.abnn import method  # noqa: F401
