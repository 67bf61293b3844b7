"""The registered post-hoc methods: importing this package imports (and so registers) each one."""

from posthoc.methods import calibration, ibnn, laplace, mc_dropout, none, swag  # noqa: F401
from posthoc.methods import dac, ivon, sgld  # noqa: F401
from posthoc.methods import sparse_vd, vi  # noqa: F401
from posthoc.methods import ensemble, mc_batchnorm  # noqa: F401
from posthoc.methods import auto  # noqa: F401  (after the methods it chooses between)
