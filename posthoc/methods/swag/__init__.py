"""``"swag"``: last-layer SWAG and SWAG over layers, fitted by a short fine-tuning (see :mod:`.method`)."""
from posthoc.methods.swag import method  # noqa: F401
