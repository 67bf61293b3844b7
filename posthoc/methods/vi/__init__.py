"""``"vi"``: mean-field Gaussian variational inference over chosen layers of a trained model."""

from posthoc.methods.vi.method import VariationalInference  # noqa: F401
