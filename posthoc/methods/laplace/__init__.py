"""placeholder"""
from posthoc.methods.laplace import method  # noqa: F401
