"""Fit-time perturbations of held-out inputs, and their strengths graded by what they do to the model.

A held-out choice made on clean validation data cannot see shift: clean data rewards the plain model. Scoring the
candidates on perturbed copies too lets the choice see inputs the model finds hard (Tomani et al., CVPR 2021). The
kinds act on the model's own input scale and never use a kind the shift harness reports: ``noise``, ``blur`` and
``impulse`` for images ``(N, C, H, W)``; ``token-replace`` for token ids; ``feature-noise`` for feature vectors
``(N, D)`` (or a dict of them). Strengths are graded per model (:func:`grade`), so a robust model gets stronger
perturbations than a fragile one.
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
    """``x + strength · std_j · N(0, 1)`` with ``std_j`` the batch's std of feature ``j`` (each of a dict's
    :func:`feature_keys`).

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
    """A dict batch's floating-point ``(N, D)`` entries, when it holds no other floating-point tensor; else none.

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
    """What inputs like ``x`` are (:data:`IMAGES`, :data:`TOKEN_IDS`, :data:`FEATURES` or :data:`OTHER`), and in words.

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
        >>> sorted(family_for(torch.randn(8, 1, 28, 28))), list(family_for({"input_ids": torch.ones(2, 5).long()}))
        (['blur', 'impulse', 'noise'], ['token-replace'])
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
    """The fit-time kinds called ``names`` for inputs like ``x`` (an unknown or unsuited name is refused).

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
    """A user's ``shift=`` callable (entry ``position``), checked on every call: called as ``f(x, generator)``, it must
    return inputs of the kind and shape it was given.

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
    """``out``, which a user's callable ``name`` returned for ``x``, if it keeps the inputs' kind and shape; else an
    :class:`~posthoc.errors.InputError` naming it.

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

    The ladder is walked upwards until ``accuracy_at(kind, parameter)`` (a running minimum) passes the last target;
    each target's parameter is interpolated in ``log parameter`` between its rungs, or is the top rung.

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
