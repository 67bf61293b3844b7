"""``"swag"``: SWAG collected during a short fine-tuning of the trained checkpoint.

The posterior is the Gaussian ``theta = mu + sqrt(scale) * (sigma * z1 + D^T z2 / sqrt(K - 1))`` over the weights
fine-tuned in ``fit`` (``scale=0``: SWA). One registered name fronts two algorithms, chosen by ``subset``:
``"all"`` (the default) or module names, :class:`~posthoc.methods.swag.subset.SubsetSWAG` (weight samples run
through the network, BatchNorm statistics recomputed per sample), and ``"last_layer"``,
:class:`~posthoc.methods.swag.last_layer.LastLayerSWAG` (Gaussian logits from one backbone pass: cheaper to
predict, for a large model). The default schedule and why: :mod:`~posthoc.methods.swag.schedule`. The user's model
is never changed: fine-tuning runs on private copies, and samples are passed to the model functionally.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader, x
    >>> um = posthoc.wrap(model, method="swag").fit(train_loader, val_loader)
    >>> um.method.summary()["scale"]      # chosen on val_loader
    128.0
    >>> um.predict(x).samples.shape
    torch.Size([20, 8, 3])
"""

from __future__ import annotations

from typing import Any

from posthoc.core.registry import register
from posthoc.methods.swag.base import SWAGBase
from posthoc.methods.swag.last_layer import LastLayerSWAG
from posthoc.methods.swag.subset import SubsetSWAG

#: the class that runs each scope of the posterior, as Laplace's :data:`~posthoc.methods.laplace.base.ALGORITHMS`
ALGORITHMS: dict[str, type[SWAGBase]] = {"last_layer": LastLayerSWAG, "subset": SubsetSWAG}


@register
class SWAG(SWAGBase):
    """SWAG (Maddox et al., 2019) fitted by a short fine-tuning of the trained model; ``wrap`` builds the class
    :meth:`algorithm` names, and this class only lists the options."""

    @classmethod
    def algorithm(cls, options: dict[str, Any]) -> type[SWAGBase]:
        """:class:`LastLayerSWAG` for ``subset="last_layer"``, else :class:`SubsetSWAG`.

        Example:
            >>> from posthoc.methods.swag.method import SWAG
            >>> SWAG.algorithm({"subset": "last_layer"}).__name__, SWAG.algorithm({}).__name__
            ('LastLayerSWAG', 'SubsetSWAG')
        """
        return ALGORITHMS["last_layer" if options.get("subset", "all") == "last_layer" else "subset"]
