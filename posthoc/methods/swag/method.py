"""``"swag"``: SWAG collected during a short fine-tuning of the trained checkpoint.

The posterior is the Gaussian ``theta = mu + sqrt(scale) * (sigma * z1 + D^T z2 / sqrt(K - 1))``
over the weights fine-tuned in ``fit`` (``scale=0``: SWA). One registered name fronts two
algorithms, chosen by ``subset`` at ``wrap()``:

- ``subset="all"`` (default) or module names: :class:`~posthoc.methods.swag.subset.SubsetSWAG`,
  weight samples run through the network with BatchNorm statistics recomputed per sample;
- ``subset="last_layer"``: :class:`~posthoc.methods.swag.last_layer.LastLayerSWAG`, Gaussian logits
  from one backbone pass.

Defaults (measured: docs/methods/swag.md): 2 epochs
of SGD (momentum 0.9, no weight decay) at a learning rate set from the model, ``1e-4`` of the
weights' norm per step over the mean mini-batch gradient norm, 4 snapshots per epoch, and, when
``fit`` gets a ``val_loader``, the scale chosen by the selection step (:mod:`posthoc.engine.selection`:
confidently within ``fit(..., tolerance=...)`` of the checkpoint's held-out NLL, then the lowest NLL on
perturbed copies; see :mod:`~posthoc.methods.swag.schedule` for why: the drift of a
longer or faster fine-tuning, not the sampling, is what made SWAG worse than the plain model under
shift). The full network stays the default: it improves most under shift, at about 20x a forward to
predict; last-layer SWAG improves less, at about 1.1x a forward: the choice for a large model or a tight
predict budget.

The user's model is never changed: fine-tuning runs on private copies, and the wrapped model keeps
the pretrained weights (samples are passed to it functionally).

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
    """SWAG (Maddox et al., 2019) fitted by a short fine-tuning of the trained model.

    ``wrap`` builds :class:`LastLayerSWAG` for ``subset="last_layer"`` and :class:`SubsetSWAG`
    otherwise (see :meth:`algorithm`); this class only lists the options.

    Options:
        subset: ``"all"``, ``"last_layer"``, or module name(s) whose parameters are fine-tuned and
            made Gaussian. Parameters the user froze (``requires_grad=False``) stay fixed.
        cov: keep the low-rank covariance part (``False``: SWAG-diagonal).
        scale: posterior scale; ``None`` chooses it on ``fit``'s ``val_loader`` (the selection step), or
            without one uses 0.5 with ``cov`` and 1.0 without; 0 gives SWA.
        num_samples: weight samples per prediction.
        bn_batches: training batches used to recompute BatchNorm statistics per sample
            (``None``: the whole loader).
        stats_device: where SWAG statistics live (e.g. ``"cpu"`` for a large model on a GPU).
        head: the head's module name for ``"last_layer"`` when it cannot be found automatically.
        seed: seeds the samples (sample ``s`` is rebuilt from ``(seed, s)``).

    Fit options: ``epochs`` (2), ``lr`` (``None``: ``1e-4 * |theta| / mean |grad|``, see
    :func:`~posthoc.methods.swag.schedule.relative_lr`), ``collect_per_epoch`` (snapshots per epoch,
    4), ``rank`` (deviations kept, 20), ``momentum`` (0.9), ``weight_decay`` (0),
    ``include_pretrained`` (count the pretrained weights as the first snapshot).
    """

    @classmethod
    def algorithm(cls, options: dict[str, Any]) -> type[SWAGBase]:
        """:class:`LastLayerSWAG` for ``subset="last_layer"``, else :class:`SubsetSWAG`.

        Example:
            >>> from posthoc.methods.swag.method import SWAG
            >>> SWAG.algorithm({"subset": "last_layer"}).__name__, SWAG.algorithm({}).__name__
            ('LastLayerSWAG', 'SubsetSWAG')
        """
        return ALGORITHMS["last_layer" if options.get("subset", "all") == "last_layer" else "subset"]
