"""Fit-time perturbations of held-out inputs, and their strengths graded by what they do to the model.

A held-out choice (a prior precision, a dropout rate, a temperature) made on clean validation data
cannot see shift: clean data rewards the plain model. Scoring the candidates on perturbed copies of
the validation batches too lets the choice see inputs the model finds hard (Tomani et al., CVPR 2021).
Each family here suits one kind of input and never uses a kind that the shift harness reports
(rotation, contrast, translation, occlusion):

- images ``(N, C, H, W)``: ``noise`` (Gaussian, in units of the batch's per-channel std), ``blur``
  (Gaussian, sigma as a fraction of the shorter side) and ``impulse`` (a fraction of the values set
  to the batch's per-channel minimum or maximum). They act on the model's own input scale, so
  normalised inputs need no normalisation constants.
- token ids (a dict with ``input_ids``, or an integer tensor): ``token-replace``, a fraction of the
  positions that the attention mask keeps replaced by ids drawn from the batch's own tokens.
- feature vectors ``(N, D)``: ``feature-noise``, Gaussian noise in units of each feature's std; also a dict
  batch of them (``{"x": (N, D), ...}``, passed to the model as keyword arguments), each floating-point ``(N, D)``
  entry perturbed alike and the others (integer codes, masks) left as they are.

Strengths are graded per model (:func:`grade`): for each kind, the parameter at which the model's
accuracy on the held-out examples falls a given fraction of the way from its clean accuracy to
chance, so a robust model gets stronger perturbations than a fragile one.

Example:
    >>> import torch
    >>> from posthoc.engine.perturb import family_for
    >>> family = family_for(torch.randn(8, 1, 28, 28))
    >>> sorted(family)
    ['blur', 'impulse', 'noise']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from torch import Tensor

from posthoc.core.inputs import Inputs
from posthoc.errors import ConfigError, InputError

#: ``perturbation(x, parameter, generator) -> x'``
Perturbation = Callable[[Inputs, float, torch.Generator], Inputs]
#: keys of dict inputs that carry images and token ids
PIXELS, TOKENS, MASK = "pixel_values", "input_ids", "attention_mask"


def _pixels(x: Inputs) -> Tensor:
    return x[PIXELS] if isinstance(x, Mapping) else x


def _with_pixels(x: Inputs, pixels: Tensor) -> Inputs:
    return {**x, PIXELS: pixels} if isinstance(x, Mapping) else pixels


def image_noise(x: Inputs, strength: float, generator: torch.Generator) -> Inputs:
    """``x + strength · std_c · N(0, 1)`` with ``std_c`` the batch's std of channel ``c``."""
    images = _pixels(x)
    std = images.float().std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-12)
    noise = torch.randn(images.shape, generator=generator, device=images.device)
    return _with_pixels(x, (images.float() + strength * std * noise).to(images.dtype))


def image_blur(x: Inputs, strength: float, generator: torch.Generator) -> Inputs:
    """Gaussian blur with sigma ``strength ·`` the shorter side, in pixels."""
    images = _pixels(x)
    sigma = max(strength * min(images.shape[-2:]), 1e-3)
    size = 2 * math.ceil(3 * sigma) + 1
    size = min(size, 2 * (min(images.shape[-2:]) // 2) - 1) if min(images.shape[-2:]) > 2 else 1
    if size < 3:
        return x
    return _with_pixels(x, TF.gaussian_blur(images.float(), [size, size], [sigma, sigma]).to(images.dtype))


def image_impulse(x: Inputs, strength: float, generator: torch.Generator) -> Inputs:
    """A fraction ``strength`` of the values set to the batch's channel minimum or maximum (half each)."""
    images = _pixels(x)
    low = images.amin(dim=(0, 2, 3), keepdim=True).expand_as(images)
    high = images.amax(dim=(0, 2, 3), keepdim=True).expand_as(images)
    draw = torch.rand(images.shape, generator=generator, device=images.device)
    out = torch.where(draw < strength / 2, low, images)
    return _with_pixels(x, torch.where((draw >= strength / 2) & (draw < strength), high, out))


def token_replace(x: Inputs, strength: float, generator: torch.Generator) -> Inputs:
    """A fraction ``strength`` of the attended positions get an id drawn from the batch's own attended ids."""
    ids = x[TOKENS] if isinstance(x, Mapping) else x
    keep = x.get(MASK) if isinstance(x, Mapping) else None
    attended = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep.bool()
    pool = ids[attended]
    if pool.numel() == 0:
        return x
    draw = torch.rand(ids.shape, generator=generator, device=ids.device)
    picks = pool[torch.randint(pool.numel(), ids.shape, generator=generator, device=ids.device)]
    replaced = torch.where((draw < strength) & attended, picks, ids)
    return {**x, TOKENS: replaced} if isinstance(x, Mapping) else replaced


def feature_noise(x: Inputs, strength: float, generator: torch.Generator) -> Inputs:
    """``x + strength · std_j · N(0, 1)`` with ``std_j`` the batch's std of feature ``j``; a dict's floating-point
    ``(N, D)`` entries each so (its other entries unchanged).

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import feature_noise
        >>> out = feature_noise({"x": torch.randn(4, 3), "ids": torch.ones(4, 2, dtype=torch.long)}, 0.5,
        ...                     torch.Generator())
        >>> sorted(out), out["ids"].sum().item()
        (['ids', 'x'], 8)
    """
    if isinstance(x, Mapping):
        return {
            key: feature_noise(value, strength, generator) if key in feature_keys(x) else value
            for key, value in x.items()
        }
    std = (
        x.float().std(dim=0, keepdim=True).nan_to_num(0.0).clamp_min(1e-12)
        if x.shape[0] > 1
        else x.float().abs().clamp_min(1e-12)
    )
    noise = torch.randn(x.shape, generator=generator, device=x.device)
    return (x.float() + strength * std * noise).to(x.dtype)


def feature_keys(x: Inputs) -> list[str]:
    """The entries of a dict batch that hold feature vectors: its floating-point ``(N, D)`` tensors, when it holds no
    other floating-point tensor (an image or a sequence of embeddings is not a feature vector); else none.

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import feature_keys
        >>> feature_keys({"x": torch.randn(4, 3), "mask": torch.ones(4, 3, dtype=torch.bool)})
        ['x']
    """
    if not isinstance(x, Mapping):
        return []
    floats = [key for key, value in x.items() if isinstance(value, Tensor) and value.is_floating_point()]
    if floats and all(x[key].dim() == 2 for key in floats):
        return floats
    return []


@dataclass(frozen=True)
class Kind:
    """One fit-time perturbation: its function and the increasing ladder of parameters :func:`grade` tries."""

    perturb: Perturbation
    ladder: tuple[float, ...]


IMAGE_KINDS = {
    "noise": Kind(image_noise, (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)),
    "blur": Kind(image_blur, (0.01, 0.02, 0.04, 0.08, 0.16)),
    "impulse": Kind(image_impulse, (0.025, 0.05, 0.1, 0.2, 0.4, 0.8)),
}
TOKEN_KINDS = {"token-replace": Kind(token_replace, (0.05, 0.1, 0.2, 0.4, 0.8))}
FEATURE_KINDS = {"feature-noise": Kind(feature_noise, (0.125, 0.25, 0.5, 1.0, 2.0, 4.0))}
#: every fit-time kind by name
FIT_KINDS: dict[str, Kind] = {**IMAGE_KINDS, **TOKEN_KINDS, **FEATURE_KINDS}


#: the input layouts :func:`input_layout` tells apart
IMAGES, TOKEN_IDS, FEATURES, OTHER = "images", "tokens", "features", "other"


def input_layout(x: Inputs) -> tuple[str, str]:
    """What inputs like ``x`` are: one of :data:`IMAGES` (``(N, C, H, W)`` or a dict with ``'pixel_values'``),
    :data:`TOKEN_IDS` (an integer tensor or a dict with ``'input_ids'``), :data:`FEATURES` (``(N, D)`` floats) or
    :data:`OTHER`, and the same in words for messages.

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import input_layout
        >>> input_layout(torch.zeros(2, 1, 28, 28))
        ('images', 'images of shape (2, 1, 28, 28)')
    """
    if isinstance(x, Mapping):
        if PIXELS in x:
            return IMAGES, f"images ('{PIXELS}')"
        if TOKENS in x:
            return TOKEN_IDS, f"token ids ('{TOKENS}')"
        return OTHER, f"a dict of {sorted(x)}"
    if not x.is_floating_point():
        return TOKEN_IDS, f"token ids of shape {tuple(x.shape)}"
    if x.dim() == 4:
        return IMAGES, f"images of shape {tuple(x.shape)}"
    if x.dim() == 2:
        return FEATURES, f"feature vectors of shape {tuple(x.shape)}"
    return OTHER, f"inputs of shape {tuple(x.shape)}"


def _suited(x: Inputs) -> tuple[str, dict[str, Kind]]:
    """What inputs like ``x`` are (in words) and the fit-time kinds that suit them (none for other layouts)."""
    layout, what = input_layout(x)
    if layout == OTHER and feature_keys(x):
        return f"feature vectors in a dict ({', '.join(map(repr, feature_keys(x)))})", FEATURE_KINDS
    return what, {IMAGES: IMAGE_KINDS, TOKEN_IDS: TOKEN_KINDS, FEATURES: FEATURE_KINDS}.get(layout, {})


def family_for(x: Inputs) -> dict[str, Kind]:
    """The fit-time perturbations that suit inputs like ``x`` (see the module docs).

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import family_for
        >>> list(family_for({"input_ids": torch.ones(2, 5, dtype=torch.long)}))
        ['token-replace']
        >>> list(family_for({"x": torch.randn(2, 5)}))
        ['feature-noise']
    """
    what, kinds = _suited(x)
    if not kinds:
        raise InputError(
            f"shift='auto' (the default of um.fit) perturbs copies of the validation batches to choose under shift, "
            f"and knows images (N, C, H, W) or a dict with '{PIXELS}', token ids (or a dict with '{TOKENS}') and "
            f"feature vectors (N, D) (or a dict of them); got {what}. Pass um.fit(..., shift=None) to choose on the "
            "clean batches, or shift=[f] with f(x, generator) -> x perturbing your inputs"
        )
    return kinds


def kinds_named(names: list[str], x: Inputs) -> dict[str, Kind]:
    """The fit-time kinds called ``names`` for inputs like ``x``; an unknown name is refused with the valid ones, and a
    kind that does not suit the inputs (blur on feature vectors, noise on token ids) with the kinds that do.

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import kinds_named
        >>> list(kinds_named(["feature-noise"], torch.randn(4, 3)))
        ['feature-noise']
    """
    unknown = [name for name in names if name not in FIT_KINDS]
    if unknown:
        raise ConfigError(
            f"unknown fit-time perturbation(s) {unknown}; valid: {', '.join(FIT_KINDS)} or callables "
            "f(x, generator) -> x"
        )
    what, suited = _suited(x)
    unsuited = [name for name in names if name not in suited]
    if unsuited:
        instead = f"the kinds that do: {', '.join(suited)}" if suited else "no fit-time kind does"
        raise ConfigError(
            f"fit-time perturbation(s) {unsuited} do not suit the inputs ({what}); {instead}, or pass "
            "shift='auto', callables f(x, generator) -> x, or shift=None"
        )
    return {name: FIT_KINDS[name] for name in names}


def user_perturbation(
    perturb: Callable[[Inputs, torch.Generator], Inputs], position: int
) -> Callable[[Inputs, torch.Generator], Inputs]:
    """A user's ``shift=`` callable (entry ``position`` of the list), checked on every call: it is called as
    ``f(x, generator)`` (a callable that cannot be, such as ``lambda x: ...``, is named with that signature) and must
    return inputs of the kind and shape it was given (one perturbed copy per example), which the held-out choice mixes
    example by example; a callable that does not is named.

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import user_perturbation
        >>> crop = user_perturbation(lambda x, generator: x[:, :2], 0)
        >>> crop(torch.zeros(4, 3), torch.Generator())
        Traceback (most recent call last):
        posthoc.errors.InputError: shift[0] (<lambda>) returned inputs of shape (4, 2) for inputs of shape (4, 3)...
        >>> user_perturbation(lambda x: x, 0)(torch.zeros(4, 3), torch.Generator())
        Traceback (most recent call last):
        posthoc.errors.ConfigError: shift[0] (<lambda>) failed when called as f(x, generator): ...
    """
    name = f"shift[{position}] ({getattr(perturb, '__name__', type(perturb).__name__)})"

    def checked(x: Inputs, generator: torch.Generator) -> Inputs:
        try:
            out = perturb(x, generator)
        except TypeError as err:
            raise ConfigError(
                f"{name} failed when called as f(x, generator): {err}. A fit-time perturbation takes the inputs and a "
                "torch.Generator and returns perturbed inputs of the same shape, e.g. shift=[lambda x, generator: "
                "x + 0.1 * torch.randn(x.shape, generator=generator, device=x.device)]"
            ) from err
        if isinstance(out, (tuple, list)):  # a torchvision v2 transform called with two inputs returns both
            raise ConfigError(
                f"{name} returned a {type(out).__name__} when called as f(x, generator); a fit-time perturbation "
                "returns the perturbed inputs alone. Wrap a one-input transform: shift=[lambda x, generator: "
                "transform(x)]"
            )
        return same_layout(out, x, name, "a fit-time perturbation", "perturbed")

    return checked


def same_layout(out: Inputs, x: Inputs, name: str, role: str, copy: str) -> Inputs:
    """``out``, which a user's callable ``name`` returned for ``x``, if it keeps the inputs' kind and shape (a
    tensor's shape, or a dict's keys and their tensors' shapes); else an :class:`~posthoc.errors.InputError` naming it.

    Example:
        >>> import torch
        >>> from posthoc.engine.perturb import same_layout
        >>> same_layout(torch.zeros(4, 2), torch.zeros(4, 3), "crop", "an augmentation", "augmented")
        Traceback (most recent call last):
        posthoc.errors.InputError: crop returned inputs of shape (4, 2) for inputs of shape (4, 3); an augmentation must...
    """
    if _layout(out) != _layout(x):
        raise InputError(
            f"{name} returned {_describe(out)} for {_describe(x)}; {role} must return inputs of the kind and "
            f"shape it is given (one {copy} copy of each example)"
        )
    return out


def _layout(x: Any) -> Any:
    """What a perturbation must keep: a tensor's shape, or a dict's keys and their tensors' shapes."""
    if isinstance(x, Tensor):
        return tuple(x.shape)
    if isinstance(x, Mapping):
        return tuple(
            sorted((key, tuple(value.shape) if isinstance(value, Tensor) else None) for key, value in x.items())
        )
    return type(x)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"inputs of shape {tuple(x.shape)}"
    if isinstance(x, Mapping):
        return "a dict of " + ", ".join(
            f"{key} {tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}" for key, v in x.items()
        )
    return f"a {type(x).__name__}"


def grade(
    accuracy_at: Callable[[Kind, float], float],
    kinds: Mapping[str, Kind],
    *,
    clean_accuracy: float,
    chance: float,
    fractions: tuple[float, ...],
) -> dict[str, tuple[float, ...]]:
    """For each kind, the parameter at which accuracy falls each of ``fractions`` of the way to chance.

    ``accuracy_at(kind, parameter)`` is the model's accuracy on held-out examples perturbed by
    ``kind`` at ``parameter``. The ladder is walked upwards until accuracy passes the last target
    (a running minimum keeps it monotone); each target's parameter is interpolated linearly in
    ``log parameter`` between the two rungs around it, or is the top rung when the kind never gets
    that far (a model robust to it).

    Example:
        >>> from posthoc.engine.perturb import Kind, grade
        >>> kind = Kind(lambda x, s, g: x, (0.1, 0.2, 0.4, 0.8))
        >>> grade(lambda kind, s: 1.0 - s, {"k": kind}, clean_accuracy=1.0, chance=0.1, fractions=(0.5,))
        {'k': (0.4...,)}
    """
    graded = {}
    for name, kind in kinds.items():
        targets = [clean_accuracy - f * (clean_accuracy - chance) for f in fractions]
        previous, lowest, rungs = (0.0, clean_accuracy), clean_accuracy, []
        for parameter in kind.ladder:
            lowest = min(lowest, accuracy_at(kind, parameter))
            rungs.append((parameter, lowest))
            if lowest <= min(targets):
                break
        parameters = []
        for target in targets:
            parameters.append(_crossing(rungs, target, start=previous))
        graded[name] = tuple(parameters)
    return graded


def _crossing(rungs: list[tuple[float, float]], target: float, *, start: tuple[float, float]) -> float:
    """The parameter where the piecewise log-linear accuracy curve through ``rungs`` reaches ``target``."""
    below = start
    for parameter, accuracy in rungs:
        if accuracy <= target:
            if below[0] <= 0 or below[1] == accuracy:
                return parameter
            weight = (below[1] - target) / (below[1] - accuracy)
            return math.exp(math.log(below[0]) + weight * (math.log(parameter) - math.log(below[0])))
        below = (parameter, accuracy)
    return rungs[-1][0]
