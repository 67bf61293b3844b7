"""placeholder"""
from posthoc.methods.mc_dropout import method  # noqa: F401
