"""``"dac"``: the density-aware per-example temperature (Tomani et al., ICML 2023), a regressor's variance inflation;
see :mod:`posthoc.methods.dac.method`."""

from posthoc.methods.dac.method import DensityAwareCalibration

__all__ = ["DensityAwareCalibration"]
