"""``"sgld"``: stochastic-gradient Langevin dynamics from the checkpoint (see :mod:`.method`)."""

from posthoc.methods.sgld.method import SGLD  # noqa: F401
