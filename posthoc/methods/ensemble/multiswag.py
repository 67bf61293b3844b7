"""``"multiswag"``: ``M`` SWAG runs from one checkpoint, mixed with equal weights (Wilson & Izmailov, 2020).

Run ``k`` is :class:`~posthoc.methods.swag.method.SWAG` with ``seed + k``, its fine-tuning's random state seeded from
``(seed, k)`` and, for a ``DataLoader`` over a map-style dataset, its own shuffled data order (:mod:`.data_order`).
Each run fine-tunes a private copy, so the runs drift to different SWAG modes; ``num_samples`` is samples per run.
Under ``likelihood="regression"`` the runs' samples make one mixture of ``N(f_s(x), σ²)`` with one noise ``σ``
re-fitted on held-out data over every run's samples.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader, x
    >>> um = posthoc.wrap(model, method="multiswag", members=3, subset="last_layer").fit(train_loader, val_loader)
    >>> um.predict(x).samples.shape          # 3 runs x 20 samples
    torch.Size([60, 8, 3])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import integer_at_least
from posthoc.core.inputs import Inputs
from posthoc.core.likelihood import Categorical, Gaussian, Likelihood, make_likelihood
from posthoc.core.method import Method
from posthoc.core.modules import eval_mode
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.objective import fit_sampled_noise
from posthoc.methods.ensemble.data_order import reshuffled
from posthoc.methods.ensemble.method import Ensemble
from posthoc.methods.swag.method import SWAG

#: run ``k``'s random state and data order are seeded with ``seed * SEED_STRIDE + k``
SEED_STRIDE = 1000


@register
class MultiSWAG(Ensemble):
    """MultiSWAG: ``members`` SWAG runs of one checkpoint with different seeds and data orders, mixed; every other
    option (and every fit option) is ``"swag"``'s."""

    name = "multiswag"
    likelihoods = (Categorical, Gaussian)
    per_output_noise = False  # one noise shared by the runs' samples and by the outputs

    @dataclass(frozen=True, kw_only=True)
    class Options(SWAG.Options):
        members: int = option(4, "SWAG runs to mix")

    FitOptions = SWAG.FitOptions

    def __init__(self, model: nn.Module, options: Options) -> None:  # type: ignore[override]  # a model, not members
        members = options.members
        integer_at_least(members, "members", 2, why="SWAG runs to mix; one run is method='swag'")
        swag = {name: value for name, value in options.as_dict().items() if name != "members"}
        algorithm = SWAG.algorithm(swag)
        self.seed = options.seed
        runs = [algorithm(model, SWAG.Options(**{**swag, "seed": options.seed + k})) for k in range(members)]
        super().__init__(runs)

    def use_likelihood(self, likelihood: Likelihood) -> None:
        """As :meth:`Method.use_likelihood`; every run gets its own fresh copy of ``likelihood`` (its own noise while it fits)."""
        super().use_likelihood(likelihood)
        for run in self.members:
            run.use_likelihood(make_likelihood(likelihood))

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: Any = None,
    ) -> None:
        """Fit every run; under a likelihood with a noise, then fit the one noise of all runs' samples (module docs)."""
        super().fit(train_loader, val_loader, progress=progress, options=options)
        self._fit_shared_noise((train_loader, val_loader))

    def _choose_members(self, held_out: Any, train_loader: Iterable | None, progress: bool) -> None:
        """Every run's scale (:meth:`Ensemble._choose_members`), then the one noise of all runs' samples again."""
        super()._choose_members(held_out, train_loader, progress)
        self._fit_shared_noise((train_loader, list(held_out.clean())))

    def _fit_shared_noise(self, loaders: tuple[Iterable | None, Iterable | None]) -> None:
        with torch.no_grad(), eval_mode(self.base_model):
            fit_sampled_noise(self.likelihood, self._sampled_outputs, loaders, self.device)
        for run in self.members:
            run.likelihood.load_state_dict(self.likelihood.state_dict())

    def _sampled_outputs(self, x: Inputs) -> Tensor:
        """``(M * S, N, D)``: every run's sampled outputs."""
        return torch.cat([run.sampled_outputs(x) for run in self.members])

    def posterior_state(self) -> dict[str, Tensor]:
        """The ensemble's state and the shared noise (the runs' mixture's likelihood)."""
        return {
            **super().posterior_state(),
            **{f"likelihood.{key}": value for key, value in self.likelihood.state_dict().items()},
        }

    @classmethod
    def fit_option_defaults(cls) -> dict[str, Any]:  # type: ignore[override]
        return SWAG.fit_option_defaults()

    def _fit_member(
        self,
        index: int,
        member: Method,
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        progress: bool,
        fit_options: dict[str, Any],
    ) -> None:
        run_seed = self.seed * SEED_STRIDE + index
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(run_seed)
            super()._fit_member(index, member, reshuffled(train_loader, run_seed), val_loader, progress, fit_options)
