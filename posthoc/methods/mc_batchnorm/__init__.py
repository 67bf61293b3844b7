"""``"mc-batchnorm"``: Monte Carlo Batch Normalisation (:mod:`posthoc.methods.mc_batchnorm.method`)."""

from posthoc.methods.mc_batchnorm import method  # noqa: F401
