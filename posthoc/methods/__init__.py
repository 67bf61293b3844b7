"""The registered post-hoc methods: importing this package imports (and so registers) each one."""

from posthoc.methods import ibnn, laplace, mc_dropout, none, swag, temperature  # noqa: F401
