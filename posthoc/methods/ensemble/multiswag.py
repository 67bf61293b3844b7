"""``"multiswag"``: ``M`` SWAG runs from one checkpoint, mixed with equal weights (Wilson & Izmailov, 2020).

Run ``k`` is the :class:`~posthoc.methods.swag.method.SWAG` method (its maths live in ``posthoc.methods.swag``) with its
``seed`` option set to ``seed + k``, its fine-tuning's random state seeded from ``(seed, k)`` (dropout
masks) and, for a ``DataLoader`` over a map-style dataset, its own shuffled data order
(:mod:`.data_order`). Each run fine-tunes a private copy, so the runs start from the same checkpoint
and drift to different SWAG modes; ``num_samples`` is samples per run. Under ``torch.distributed``
the runs are spread over ranks like ensemble members.

Example:
    >>> um = posthoc.wrap(model, method="multiswag", members=3, subset="last_layer").fit(train_loader, val_loader)
    >>> um.predict(x).samples.shape          # 3 runs x 20 samples
    torch.Size([60, 8, 10])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from posthoc.core.checks import integer_at_least, known_options
from posthoc.core.likelihood import Categorical
from posthoc.core.method import Method
from posthoc.core.registry import register
from posthoc.methods.ensemble.data_order import reshuffled
from posthoc.methods.ensemble.method import Ensemble
from posthoc.methods.swag.method import SWAG

#: run ``k``'s random state and data order are seeded with ``seed * SEED_STRIDE + k``
SEED_STRIDE = 1000


@register
class MultiSWAG(Ensemble):
    """MultiSWAG: ``members`` SWAG runs of one checkpoint with different seeds and data orders, mixed.

    Options: ``members`` (runs, 4) and every option of ``"swag"`` (``subset``, ``cov``, ``scale``,
    ``num_samples`` per run, ``seed``, ...). Fit options: those of ``"swag"`` (``epochs``, ``lr``, ...).
    """

    name = "multiswag"
    likelihoods = (Categorical,)  # SWAG fine-tunes on the class NLL

    def __init__(self, model: nn.Module, *, members: int = 4, **swag_options: Any) -> None:
        integer_at_least(members, "members", 2, why="SWAG runs to mix; one run is method='swag'")
        known_options(swag_options, self.option_defaults(), "multiswag")
        options = {**SWAG.option_defaults(), **swag_options}
        algorithm = SWAG.algorithm(options)
        self.seed = options["seed"]
        runs = [algorithm(model, **{**options, "seed": options["seed"] + k}) for k in range(members)]
        super().__init__(runs)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return {"members": 4, **SWAG.option_defaults()}

    @classmethod
    def fit_option_defaults(cls) -> dict[str, Any]:  # type: ignore[override]
        return SWAG.fit_option_defaults()

    def _fit_member(self, index: int, member: Method, train_loader: Iterable | None, val_loader: Iterable | None,
                    progress: bool, fit_options: dict[str, Any]) -> None:
        run_seed = self.seed * SEED_STRIDE + index
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(run_seed)
            super()._fit_member(index, member, reshuffled(train_loader, run_seed), val_loader, progress, fit_options)
