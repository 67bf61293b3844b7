"""``"ibnn"``: node posteriors on a pretrained network (nodes, ELBO fitting, the expanded predictive)."""

from posthoc.methods.ibnn import method  # noqa: F401
