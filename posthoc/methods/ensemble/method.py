"""The ensemble method: an equal-weight mixture of ``M`` member methods, one per checkpoint.

``posthoc.wrap([m1, m2, m3])`` is a deep ensemble (each member the plain model); ``posthoc.wrap([m1, m2, m3],
method="laplace")`` fits Laplace on every member and mixes the three posteriors. The predictive is
``p(y|x) = (1/M) sum_m p_m(y|x)``; ``Prediction.samples`` holds every member's samples (``num_samples`` always means
samples *per member*), so the entropy split gives the members' disagreement as epistemic uncertainty. A stacked
calibrator maps each member's predictive before they are mixed, which keeps the members' samples.

Plain members of one architecture can run as one vmapped forward (:mod:`.batched`), by default on a GPU only
(docs/methods/ensembles.md). A saved ensemble only loads onto the same members in the same order
(``member_fingerprints``). Under ``likelihood="regression"`` each member fits its own noise and the predictive is the
mixture of the members' Gaussians: their disagreement is epistemic variance, their noises the aleatoric.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import net_a, net_b, net_c, x
    >>> um = posthoc.wrap([net_a, net_b, net_c])
    >>> pred = um.predict(x)
    >>> pred.samples.shape, bool((pred.epistemic > 0).any())
    (torch.Size([3, 8, 3]), True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from posthoc.core import persistence
from posthoc.core.checks import one_of
from posthoc.core.inputs import Inputs
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian
from posthoc.core.method import LogPredictive, Method
from posthoc.core.prediction import RegressionPrediction, mix_predictions
from posthoc.core.registry import ENSEMBLE, register
from posthoc.engine.choice import make_choice, makes_choice
from posthoc.engine.ranks_spread import fit_spread
from posthoc.errors import ConfigError
from posthoc.methods.ensemble.batched import BatchedForward, same_architecture
from posthoc.methods.ensemble.members import check_members
from posthoc.methods.ensemble.mixture import batched_mixture, mixture

#: builds a spec entry's method around one model: ``(method, fingerprint of the model if the method copies it)``
MemberBuilder = Callable[[nn.Module, dict[str, Any]], tuple[Method, str | None]]


class Mixture(nn.Module):
    """The exported form of an ensemble: the :func:`~posthoc.methods.ensemble.mixture.mixture` of its members'
    predictive modules (classification), or their Gaussian components side by side (regression)."""

    def __init__(self, members: list[nn.Module], *, regression: bool = False) -> None:
        super().__init__()
        self.members, self.regression = nn.ModuleList(members), regression

    def forward(self, x: Any) -> LogPredictive | tuple[torch.Tensor, torch.Tensor]:
        parts = [member(x) for member in self.members]
        if self.regression:
            return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
        return mixture(parts)


@register
class Ensemble(Method):
    """An equal-weight mixture of member methods, one per checkpoint (module docs); built by ``posthoc.wrap([...])``.

    ``batched``: run plain members of one architecture as one vmapped forward (``None``: on CUDA only). ``sources``:
    per member, the fingerprint of the user's checkpoint where the member works on a copy (``None``: taken at fit).
    """

    name = ENSEMBLE
    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)  # the members' own are checked as they are built
    per_output_noise = True  # as the members' own (each member refuses a noise per output it cannot use)
    exports = ("classification", "regression")  # the members' own are checked one by one

    def to_module(self, export: Any) -> nn.Module:
        """The equal-weight mixture of the members' exported predictives."""
        return Mixture([export.predictive(member) for member in self.members], regression=export.regression)

    def __init__(
        self, members: Sequence[Method], *, batched: bool | None = None, sources: Sequence[str | None] | None = None
    ) -> None:
        if len(members) < 1:
            raise ConfigError("an ensemble needs at least one member")
        one_of(batched, "batched", (None, True, False))
        super().__init__(members[0].base_model)
        self.members = nn.ModuleList(members)
        self.fitted.fill_(not self.requires_fit)
        self.sources = list(sources) if sources is not None else [None] * len(members)
        models = [member.base_model for member in members]
        stackable = all(type(member).name == "none" for member in members) and same_architecture(models)
        if batched and not stackable:
            raise ConfigError(
                "batched=True needs plain members (method 'none') of one architecture (same class, parameter "
                "names, shapes, dtypes and devices); pass batched=None to fall back to a loop"
            )
        self.batched_forward = BatchedForward(models) if stackable and batched is not False else None
        self.batched = batched
        self.register_buffer("member_fingerprints", None)
        if not self.requires_fit:
            self._bind_fingerprints()

    @classmethod
    def around(
        cls, models: Sequence[nn.Module], entry: dict[str, Any], build: MemberBuilder
    ) -> tuple[Ensemble, str | None]:
        """The ensemble of the spec ``entry`` (``{"name", "options", "members", "batched"}``): its method built by
        ``build`` around each of ``models`` after they are checked, and the first member's fingerprint where it is
        taken at wrap (members that work on a copy).

        Example:
            >>> from posthoc.methods.ensemble.method import Ensemble
            >>> from posthoc_apps.demo.examples import net_a, net_b
            >>> from posthoc.core.chain import base_method
            >>> ensemble, _ = Ensemble.around([net_a, net_b], {"name": "none", "options": {}, "members": 2}, base_method)
            >>> len(ensemble.members)
            2
        """
        if len(models) != entry.get("members", len(models)):
            raise ConfigError(f"the spec names an ensemble of {entry['members']} members, got {len(models)} models")
        check_members(models)
        built = [build(model, entry) for model in models]
        members = [member for member, _ in built]
        return cls(members, batched=entry.get("batched"), sources=[source for _, source in built]), built[0][1]

    @property
    def requires_fit(self) -> bool:  # type: ignore[override]  # derived: fitted when any member is
        return any(member.requires_fit for member in self.members)

    @property
    def needs_val(self) -> bool:  # type: ignore[override]
        return any(member.needs_val for member in self.members)

    @property
    def base_model(self) -> nn.Module:
        """The first member's model (what detectors and the model card look at)."""
        return self.members[0].base_model

    @property
    def works_on_copy(self) -> bool:
        return all(member.works_on_copy for member in self.members)

    def fit_option_defaults(self) -> dict[str, Any]:  # type: ignore[override]  # the members' fit options
        return self.members[0].fit_option_defaults()

    def make_fit_options(self, values: dict[str, Any]) -> Any:  # type: ignore[override]  # the members' fit options
        return self.members[0].make_fit_options(values)

    def _bind_fingerprints(self) -> None:
        found = [
            source or persistence.fingerprint(member.base_model) for source, member in zip(self.sources, self.members)
        ]
        self.member_fingerprints = torch.stack([persistence.fingerprint_tensor(f) for f in found]).to(self.device)

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: Any = None,
    ) -> None:
        """Fit every member on the same loaders (spread over ranks under ``torch.distributed``) with the members'
        fit ``options`` (:meth:`make_fit_options`)."""
        fit_options = {} if options is None else {"options": options}
        fit_spread(
            self.members,
            lambda index, member: self._fit_member(index, member, train_loader, val_loader, progress, fit_options),
            loaders=(train_loader, val_loader),
        )
        self._bind_fingerprints()
        self.fitted.fill_(True)

    def _fit_member(
        self,
        index: int,
        member: Method,
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        progress: bool,
        fit_options: dict[str, Any],
    ) -> None:
        member.fit(train_loader, val_loader, progress=progress, **fit_options)
        member.fitted.fill_(True)

    def knob(self) -> Knob | None:
        """The members' held-out choices (its own ``choose``: each member's knob, judged against its own checkpoint)."""
        if not any(makes_choice(member) for member in self.members):
            return None
        return Knob(name="members' choices", choose=self._choose_members)

    def _choose_members(self, held_out: Any, train_loader: Iterable | None, progress: bool) -> None:
        """Every member's held-out choice on the same held-out batches, each judged against its own checkpoint
        (``held_out.rebased``), spread over ranks as the fits are."""

        def choose_one(index: int, member: Method) -> None:
            if makes_choice(member):
                make_choice(member, held_out.rebased(member.plain_model), train_loader=train_loader, progress=progress)

        fit_spread(self.members, choose_one, loaders=())

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        if self.vmapped:
            return batched_mixture(self.batched_forward(x))
        return mixture(
            [member.log_predictive(x, num_samples=num_samples, generator=generator) for member in self.members]
        )

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """The equal-weight mixture of the members' regression predictives (see module docs)."""
        return mix_predictions(
            [member.regression_predictive(x, num_samples=num_samples, generator=generator) for member in self.members]
        )

    @property
    def vmapped(self) -> bool:
        """Whether ``predict`` runs the members as one vmapped forward (see ``batched``)."""
        return self.batched_forward is not None and (self.batched is True or self.device.type == "cuda")

    def posterior_state(self) -> dict[str, torch.Tensor]:
        """Every member's posterior under ``members.<i>.``, and the member fingerprints."""
        state = {name: value for name, value in self._buffers.items() if value is not None}
        for index, member in enumerate(self.members):
            state.update({f"members.{index}.{key}": value for key, value in member.posterior_state().items()})
        return state

    def load_posterior_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`posterior_state` saved, each member's part through the member's own loader."""
        own = {key: value for key, value in state.items() if not key.startswith("members.")}
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.members]
        for key, value in state.items():
            if key.startswith("members."):
                index, _, rest = key[len("members.") :].partition(".")
                if not index.isdigit() or int(index) >= len(self.members):
                    raise KeyError(key)
                parts[int(index)][rest] = value
        super().load_posterior_state(own)
        for member, part in zip(self.members, parts):
            member.load_posterior_state(part)

    def summary(self) -> dict[str, Any]:
        """``random_variables`` summed over members, ``members``, the member method, its layers, and each
        member's own card under ``per_member`` (what each fit chose, e.g. its prior precision).

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import net_a, net_b, train_loader
            >>> posthoc.wrap([net_a, net_b], method="laplace").fit(train_loader).method.summary()["members"]
            2
        """
        cards = [{**member.summary(), **member.likelihood.summary()} for member in self.members]
        layers = list(dict.fromkeys(layer for card in cards for layer in card.get("layers", [])))
        return {
            "random_variables": sum(int(card.get("random_variables") or 0) for card in cards),
            "layers": layers,
            "members": len(cards),
            "member_method": type(self.members[0]).name,
            "batched": self.vmapped,
            "per_member": {str(i): {k: v for k, v in card.items() if k != "layers"} for i, card in enumerate(cards)},
        }
