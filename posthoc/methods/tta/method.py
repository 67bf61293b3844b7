"""``"tta"``: test-time augmentation, the predictive mixed over augmented views of each input; stacks on any method.

The predictive is the equal-weight mixture over ``V`` views ``x_1 = x`` and ``x_v = a_v(x)`` through the inner
method's predictive, ``p(y | x) = (1/V) Σ_v p_inner(y | x_v)``; the samples are the inner's samples of every view,
``(V·S, N, C)``, so the views' disagreement reads as epistemic (under regression: a mixture of ``V·K`` Gaussians).

The views are the identity, then the families in turn (:mod:`posthoc.methods.tta.augment`: ``noise``, ``blur``,
``zoom`` for images, ``feature-noise`` for feature vectors) or the user's callables ``x -> x'``; none is an evaluation
kind (:data:`posthoc.shift.EVALUATION_KINDS`). They are drawn from a generator seeded with ``seed`` on the input's
device, so a prediction repeats exactly. ``strength="auto"`` is chosen on ``val_loader`` by the selection step among
no augmentation and :data:`STRENGTHS`. ``fit`` measures only the training inputs' per-channel or per-feature std,
which scales the noise families.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="tta", views=4).fit(train_loader)
    >>> um.predict(x).samples.shape                 # four views of eight inputs
    torch.Size([4, 8, 3])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import integer, positive_int
from posthoc.core.chunks import rows_per_chunk
from posthoc.core.inputs import Inputs, batch_size, iterate
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian
from posthoc.core.logits import log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.options import option
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.perturb import PIXELS, input_layout
from posthoc.engine.runner import sum_over_ranks
from posthoc.errors import ConfigError, InputError
from posthoc.methods.tta.augment import SCALED, Views, check_augmentations, concat, families_for

#: the strengths the selection step walks through, after no augmentation
STRENGTHS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
#: the strength used without a held-out choice (``strength="auto"`` and no ``val_loader``)
DEFAULT_STRENGTH = 0.25
#: training rows the per-channel or per-feature std is measured on
STATISTICS_ROWS = 4096


def _input_bytes(x: Inputs) -> int:
    tensors = x.values() if isinstance(x, dict) else [x]
    return sum(t.element_size() * t.numel() for t in tensors if isinstance(t, Tensor))


def _device(x: Inputs) -> torch.device:
    return (next(iter(x.values())) if isinstance(x, dict) else x).device


@register
class TestTimeAugmentation(Method):
    """The ``inner`` predictive averaged over ``views`` augmented views of each input (the identity among them)."""

    __test__ = False  # not a pytest class, whatever its name says
    name = "tta"
    stacks = True
    knob_name = "augmentation strength"
    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        augmentations: list[str | Callable] | str = option(
            "auto", "auto (every built-in family that suits the inputs), or family names and callables x -> x'"
        )
        views: int = option(8, "views per input, the identity included (1: the inner predictive)")
        strength: float | str = option(
            "auto", "the factor on the families' parameters; auto: chosen on val_loader (0.25 without one)"
        )
        seed: int = option(0, "the seed of the views' draws")

    def __init__(self, inner: Method, options: Options) -> None:
        augmentations, views, strength, seed = options.augmentations, options.views, options.strength, options.seed
        super().__init__(inner.base_model)
        self.inner = inner
        self.likelihood = inner.likelihood
        self.augmentations = check_augmentations(augmentations)
        self.views = positive_int(views, "views")
        if strength != "auto" and (
            isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength < math.inf
        ):
            raise ConfigError(f"strength must be a number >= 0 (0: no augmentation) or 'auto', got {strength!r}")
        self.auto_strength, self.seed = strength == "auto", integer(seed, "seed")
        named = [] if self.augmentations == "auto" else [a for a in self.augmentations if isinstance(a, str)]
        #: whether a built-in family is used, which the strength scales (else only the callables, "on" at 1)
        self.scales = self.augmentations == "auto" or bool(named)
        self.needs_statistics = self.augmentations == "auto" or any(name in SCALED for name in named)
        initial = (DEFAULT_STRENGTH if self.scales else 1.0) if self.auto_strength else float(strength)
        self.register_buffer("strength", torch.tensor(initial, dtype=torch.float64))
        #: the training inputs' per-channel (images) or per-feature std (empty before fit)
        self.register_buffer("scale", torch.zeros(0))
        self.fitted.fill_(not self.requires_fit)
        self._views: tuple[str, Views] | None = None

    @property
    def requires_fit(self) -> bool:  # type: ignore[override]  # the noise families' std, or the inner's fit
        return self.needs_statistics or self.inner.requires_fit

    @property
    def base_model(self) -> nn.Module:
        return self.inner.base_model

    # ---- views -------------------------------------------------------------------------------
    def views_for(self, x: Inputs) -> Views:
        """The views of inputs like ``x`` (the families resolved once per input layout)."""
        layout, _ = input_layout(x)
        if self._views is None or self._views[0] != layout:
            self._views = (layout, Views(families_for(self.augmentations, x), self.views))
        return self._views[1]

    def _scale_for(self, x: Inputs) -> Tensor:
        """The fitted std, checked against the inputs' channels or features (families that need it only)."""
        if not self.needs_statistics:
            return self.scale
        if self.scale.numel() == 0:
            raise InputError(
                "tta's noise families are scaled by the training inputs' std, not measured yet: call "
                "um.fit(train_loader) first (or posthoc.load a fitted one)"
            )
        images = x[PIXELS] if isinstance(x, dict) else x
        width = images.shape[1]
        if width != self.scale.numel():
            raise InputError(
                f"tta measured the std of {self.scale.numel()} channels or features at fit, but these "
                f"inputs have {width}; pass inputs of the kind it was fitted on"
            )
        return self.scale

    def _generator(self, x: Inputs, generator: torch.Generator | None) -> torch.Generator:
        """The views' own generator on the inputs' device: seeded with ``seed``, or from one draw of ``generator``."""
        device = _device(x)
        seed = (
            self.seed
            if generator is None
            else int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        )
        return torch.Generator(device=device).manual_seed(seed)

    def _groups(self, x: Inputs) -> list[range]:
        """The views in groups whose concatenated inputs fit the memory budget (at least one view a group)."""
        step = rows_per_chunk(_input_bytes(x), limit=self.views)
        return [range(start, min(self.views, start + step)) for start in range(0, self.views, step)]

    # ---- predictive --------------------------------------------------------------------------
    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        strength = float(self.strength)
        if strength == 0 or self.views == 1:
            return self.inner.log_predictive(x, num_samples=num_samples, generator=generator)
        views, scale, n = self.views_for(x), self._scale_for(x), batch_size(x)
        draws = self._generator(x, generator)
        per_view, samples = [], []
        for group in self._groups(x):
            log_probs, drawn = self.inner.log_predictive(
                concat(views.make(x, strength, draws, scale, group)), num_samples=num_samples, generator=generator
            )
            per_view.append(log_probs.unflatten(0, (len(group), n)))  # (v, n, C)
            samples.append(_view_major(log_probs, drawn, len(group), n))
        return log_mean_exp(torch.cat(per_view), 0), torch.cat(samples)

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """The equal-weight mixture of the views' predictives: ``V·K`` Gaussian components per example."""
        strength = float(self.strength)
        if strength == 0 or self.views == 1:
            return self.inner.regression_predictive(x, num_samples=num_samples, generator=generator)
        views, scale, n = self.views_for(x), self._scale_for(x), batch_size(x)
        draws = self._generator(x, generator)
        parts: list[tuple[Tensor, Tensor, Tensor]] = []
        for group in self._groups(x):
            prediction = self.inner.regression_predictive(
                concat(views.make(x, strength, draws, scale, group)), num_samples=num_samples, generator=generator
            )
            if prediction.recalibrated:
                raise ConfigError("tta mixes Gaussian components; it cannot mix a recalibrated inner prediction")
            components = [
                prediction.component_means,
                prediction.model_variances,
                prediction.noise.expand_as(prediction.component_means),
            ]
            # (K, v·n, D) -> (v·K, n, D), view-major
            parts.append(tuple(c.unflatten(1, (len(group), n)).transpose(0, 1).flatten(0, 1) for c in components))
        means, variances, noise = (torch.cat(items) for items in zip(*parts))
        return RegressionPrediction.from_components(means, variances, noise)

    # ---- fit and choice ----------------------------------------------------------------------
    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """The training inputs' per-channel (images) or per-feature std, for the noise families; the families are
        checked against the inputs here."""
        if train_loader is None and not self.needs_statistics:
            return
        total = count = None
        for x, _ in iterate(
            train_loader, device=self.device, progress=progress, desc="tta: input statistics", require_labels=False
        ):
            self.views_for(x)  # refuses families that do not suit the inputs
            if not self.needs_statistics:
                return
            values = (x[PIXELS] if isinstance(x, dict) else x).double()
            values = values.transpose(0, 1).flatten(1) if values.dim() == 4 else values.T  # (C or D, rows)
            stats = torch.stack([torch.full_like(values[:, 0], values.shape[1]), values.sum(1), values.square().sum(1)])
            total = stats if total is None else total + stats
            count = (count or 0) + batch_size(x)
            if count >= STATISTICS_ROWS:
                break
        if total is None:
            raise InputError(
                "tta measures the training inputs' std for its noise families and got no batch: call "
                "um.fit(train_loader) with a non-empty loader"
            )
        rows, sums, squares = sum_over_ranks(total)
        mean = sums / rows
        variance = (squares / rows - mean.square()).clamp_min(0) * rows / (rows - 1).clamp_min(1)
        self.scale = variance.sqrt().float().to(self.device)

    def knob(self) -> Knob | None:
        """``strength="auto"``: the strength by the selection step, no augmentation first, then :data:`STRENGTHS`
        (callables alone: on)."""
        if not (self.auto_strength and self.views > 1):
            return None
        strengths = STRENGTHS if self.scales else (1.0,)
        return Knob(
            name=self.knob_name,
            candidates=[("no augmentation", 0.0), *[(f"strength {s:g}", s) for s in strengths]],
            score=self._strength_scores,
            apply=lambda value: self.strength.fill_(float(value)),
            movable=True,
        )

    def _strength_scores(self, value: float, held_out: Any) -> Any:
        if value == 0 and self.likelihood.prediction_type is not RegressionPrediction and self.inner.name == "none":
            return held_out.plain  # the plain model itself
        self.strength.fill_(value)
        return held_out.method_scores(self)

    # ---- card ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The views, the augmentations (callables by position), the strength in use (0: no augmentation)."""
        names = (
            ["auto"]
            if self.augmentations == "auto"
            else [
                a if isinstance(a, str) else f"callable {getattr(a, '__name__', type(a).__name__)}"
                for a in self.augmentations
            ]
        )
        families = [] if self._views is None else [name for name, _ in self._views[1].families]
        return {
            "random_variables": 0,
            "layers": [],
            "views": self.views,
            "augmentations": names,
            "families": families,
            "strength": float(self.strength),
            "scale": [round(float(s), 6) for s in self.scale[:16]],
        }

    def extra_repr(self) -> str:
        return f"views={self.views}, strength={float(self.strength):g}"


def _view_major(log_probs: Tensor, samples: Tensor | None, views: int, n: int) -> Tensor:
    """The inner's samples of ``views`` concatenated views as ``(views·S, n, C)``, view-major (its predictive
    ``(views, n, C)`` where it has no samples)."""
    if samples is None:
        return log_probs.unflatten(0, (views, n))
    return samples.unflatten(1, (views, n)).transpose(0, 1).flatten(0, 1)
