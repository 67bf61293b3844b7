"""The registered post-hoc methods: importing this package imports (and so registers) each one."""

from posthoc.methods import (  # noqa: F401
    abnn,
    auto,  # noqa: F401  (after the methods it chooses between)
    calibration,
    dac,
    ensemble,
    ibnn,
    ivon,
    label_shift,
    laplace,
    mc_batchnorm,
    mc_dropout,
    none,
    sgld,
    sparse_vd,
    swag,
    tta,
    vi,
)
