"""placeholder"""
from posthoc.methods.swag import method  # noqa: F401
