"""``"swag"``: last-layer SWAG and SWAG over layers, fitted by a short fine-tuning (see :mod:`.method`);
:class:`SWAGCollector` collects the same moments in a training loop of your own."""

from posthoc.methods.swag import method  # noqa: F401
from posthoc.methods.swag.collector import SWAGCollector

__all__ = ["SWAGCollector"]
