"""The registered post-hoc methods: importing this package imports (and so registers) each one."""

from posthoc.methods import calibration, ibnn, laplace, mc_dropout, none, swag  # noqa: F401
