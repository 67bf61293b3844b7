"""placeholder"""
from posthoc.methods.ibnn import method  # noqa: F401
