"""The modules ``um.to_module()`` is made of: plain torch, no posthoc import, so this file can be copied on its own.

Every piece maps the user's inputs to a predictive with its fitted constants held as buffers. A
*predictive* module returns ``(log_probs (N, C), samples (S, N, C) or None)`` (classification) or
``(means (K, N, D), variances (K, N, D))`` (regression, ``K`` Gaussian components); the top modules
:class:`ExportedClassifier` and :class:`ExportedRegressor` turn that into probabilities, or into a mean and
a variance. :class:`Backbone` runs the user's network once per call and keeps what its taps saw (the
head's input, the features density-aware calibration reads), so the pieces stacked on it share one pass.

This file imports only ``torch``: a serving process that loads a ``torch.export`` program needs none of it,
and one that pickles the module itself needs only this file and the network's own classes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.export.modules import Backbone, ExportedClassifier, Plain
    >>> net = nn.Sequential(nn.Linear(4, 3))
    >>> exported = ExportedClassifier(Plain(Backbone(net)))
    >>> torch.allclose(exported(torch.randn(2, 4)).sum(-1), torch.ones(2))
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

#: log-probabilities below this are clamped before a calibrator or a temperature sees them (posthoc's floor)
LOG_PROB_FLOOR = -1e4
#: the smallest probability a binned map (histogram, isotonic) gives a class
BIN_FLOOR = 1e-6
#: distances below this are taken as this before the log (density-aware calibration)
MIN_DISTANCE = 1e-6


# ---------------------------------------------------------------------------------------------------- helpers
def logits_of(output: Any) -> Tensor:
    """A network's logits: the tensor itself, or the ``logits`` field of a Hugging Face output or a dict."""
    if isinstance(output, Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, dict):
        found = output.get("logits")
    if not isinstance(found, Tensor):
        raise TypeError(f"the network returned {type(output).__name__}, with no tensor of logits")
    return found


def class_logits(logits: Tensor) -> Tensor:
    """``(N, C)`` class logits; a binary classifier's one logit ``(N,)`` or ``(N, 1)`` becomes ``[0, z]``."""
    if logits.dim() == 1 or logits.shape[-1] == 1:
        z = logits.reshape(-1, 1)
        return torch.cat([torch.zeros_like(z), z], dim=1)
    return logits


def class_log_probs(logits: Tensor) -> Tensor:
    """``log_softmax`` of :func:`class_logits`, in at least float32 (half-precision logits are upcast first)."""
    logits = class_logits(logits)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, -1)


def log_mean_exp(samples: Tensor, dim: int = 0) -> Tensor:
    """``log(mean(exp(samples), dim))``, shifted by the maximum for stability."""
    top = samples.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return (samples - top).exp().mean(dim=dim).log() + top.squeeze(dim)


def cast(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` in ``dtype``, with no cast at all where it is in it already (the TorchScript-based ONNX exporter
    writes a no-op cast of a buffer as a node without an input)."""
    return value if value.dtype == dtype else value.to(dtype)


def first_tensor(value: Any) -> Tensor | None:
    """The tensor a module's output carries: itself, a tuple's first, a Hugging Face output's ``last_hidden_state``."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
        return None
    hidden = getattr(value, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    if isinstance(value, Mapping):
        for item in value.values():
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def pooled(value: Tensor) -> Tensor:
    """An activation pooled to ``(N, D)`` float32: tokens averaged, feature maps averaged over their positions."""
    if value.dim() == 3:
        value = value.mean(1)
    elif value.dim() == 4 and value.shape[1] == value.shape[2] and value.shape[2] != value.shape[3]:
        value = value.mean((1, 2))  # channels last (N, H, W, C)
    elif value.dim() > 3:
        value = value.flatten(2).mean(2)
    return value.float()


class _Recorder:
    """A forward (pre-)hook keeping, in its backbone's ``_found``, the first value one tap sees in a call (a plain
    class, so that it deep-copies; it looks the dict up on every call, as tracers may replace it)."""

    def __init__(self, backbone: Backbone, index: int, at: str) -> None:
        self.backbone, self.index, self.at = backbone, index, at

    def __call__(self, module: nn.Module, args: tuple, *output: Any) -> None:
        found = self.backbone._found
        if self.index not in found:
            value = first_tensor(args if self.at == "input" else output[0])
            if value is not None:
                found[self.index] = value


class Backbone(nn.Module):
    """The user's network, run once per call; ``taps`` keep the input or output of named modules.

    ``forward(x)`` returns the network's logits (or outputs) for ``x`` (a tensor, or a dict of tensors passed as
    keyword arguments); :meth:`tapped` then gives what tap ``index`` saw in that call.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.export.modules import Backbone
        >>> backbone = Backbone(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        >>> index = backbone.add_tap("2", "input")
        >>> backbone(torch.randn(5, 4)).shape, backbone.tapped(index).shape
        (torch.Size([5, 3]), torch.Size([5, 8]))
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.taps: list[tuple[str, str]] = []
        self._found: dict[int, Tensor] = {}

    def add_tap(self, name: str, at: str) -> int:
        """Keep the ``at`` (``"input"`` or ``"output"``) of module ``name`` in every call; its index (one per site)."""
        if (name, at) in self.taps:
            return self.taps.index((name, at))
        index = len(self.taps)
        self.taps.append((name, at))
        module = self.model.get_submodule(name)
        recorder = _Recorder(self, index, at)
        if at == "input":
            module.register_forward_pre_hook(recorder)
        else:
            module.register_forward_hook(recorder)
        return index

    def forward(self, x: Any) -> Tensor:
        self._found = {}
        output = self.model(**x) if isinstance(x, Mapping) else self.model(x)
        return logits_of(output)

    def tapped(self, index: int) -> Tensor:
        """What tap ``index`` saw in the last call."""
        if index not in self._found:
            name, at = self.taps[index]
            raise RuntimeError(f"the network's forward did not reach the {at} of '{name}'")
        return self._found[index]


# ---------------------------------------------------------------------------------------------------- classification
class Plain(nn.Module):
    """The network's own softmax: ``log_softmax(logits)``."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        return class_log_probs(self.backbone(x)), None


class HeadGaussian(nn.Module):
    """Gaussian logits of a linear head (last-layer Laplace): ``N(f(x), J Σ Jᵀ)`` through a link.

    The logits' variance is read from the head's input ``phĩ = [phi, 1]`` with the posterior folded into buffers at
    export (``structure``): ``"diag"``: ``phĩ² @ inverse``; ``"kron"``: ``((phĩ U_A)² @ inverse) @ (U_G²)ᵀ``;
    ``"full"``: ``(phĩ V)² @ spread``. Links: ``"probit"`` (``softmax(m / sqrt(1 + π/8 · var))``), ``"bridge"``
    (the Laplace bridge; diag and kron) and ``"samples"``: head weights ``(S, C, D+1)`` drawn once at export, the
    same draws for every input (logits linear in the weights, so each input's samples are its Gaussian logits).
    """

    def __init__(
        self,
        backbone: Backbone,
        tap: int,
        structure: str,
        link: str,
        bias: bool,
        factors: dict[str, Tensor],
        weight_samples: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.backbone, self.tap, self.structure, self.link, self.bias = backbone, tap, structure, link, bias
        for name, value in factors.items():
            self.register_buffer(name, value)
        self.register_buffer("weight_samples", weight_samples)

    def augmented(self, phi: Tensor) -> Tensor:
        """``phĩ = [phi, 1]`` (``phi`` alone for a head without a bias), in at least float32."""
        phi = cast(phi, torch.promote_types(phi.dtype, torch.float32))
        return torch.cat([phi, torch.ones_like(phi[:, :1])], 1) if self.bias else phi

    def scale_and_basis(self, phi_aug: Tensor) -> tuple[Tensor, Tensor | None]:
        """Standard deviations ``(N, K)`` along the columns of a basis ``(C, K)`` (``None``: independent logits)."""
        dtype = phi_aug.dtype
        if self.structure == "diag":
            return (phi_aug.square() @ cast(self.inverse, dtype)).sqrt(), None
        if self.structure == "kron":
            scale = ((phi_aug @ cast(self.in_eigvecs, dtype)).square() @ cast(self.inverse, dtype)).sqrt()
            return scale, cast(self.out_eigvecs, dtype)
        return ((phi_aug @ cast(self.vectors, dtype)).square() @ cast(self.spread, dtype)).sqrt(), None

    def variance(self, phi_aug: Tensor) -> Tensor:
        scale, basis = self.scale_and_basis(phi_aug)
        return scale.square() if basis is None else scale.square() @ basis.square().T

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        raw = self.backbone(x)
        phi_aug = self.augmented(self.backbone.tapped(self.tap))
        logits = cast(raw, phi_aug.dtype)
        if self.link == "samples":
            weights = cast(self.weight_samples, phi_aug.dtype)
            samples = torch.log_softmax(torch.einsum("nd,scd->snc", phi_aug, weights), -1)
            return log_mean_exp(samples), samples
        if self.link == "probit":
            return torch.log_softmax(torch.rsqrt(1 + math.pi / 8 * self.variance(phi_aug)) * logits, -1), None
        scale, basis = self.scale_and_basis(phi_aug)
        if basis is None:
            var_diag = row_sums = scale.square()
        else:
            var_diag = scale.square() @ basis.square().T
            row_sums = (scale.square() * basis.sum(0)) @ basis.T
        tiny = torch.finfo(logits.dtype).tiny
        total = row_sums.sum(-1, keepdim=True).clamp_min(tiny)
        mean = logits - row_sums * logits.sum(-1, keepdim=True) / total
        var = (var_diag - row_sums.square() / total).clamp_min(torch.finfo(logits.dtype).eps)
        classes = mean.shape[-1]
        alpha = (1 - 2 / classes + mean.exp() / classes**2 * torch.exp(-mean).sum(-1, keepdim=True)) / var
        return torch.log(alpha) - torch.log(alpha.sum(-1, keepdim=True)), None


class HeadSamples(nn.Module):
    """A linear head under ``S`` weight draws fixed at export: ``logits_s = phi @ W_sᵀ + b_s`` (SWAG's last layer, MC
    dropout on the head's input as ``W_s = W diag(mask_s / q)``); every input sees the same ``S`` draws."""

    def __init__(self, backbone: Backbone, tap: int, weights: Tensor, biases: Tensor | None) -> None:
        super().__init__()
        self.backbone, self.tap = backbone, tap
        self.register_buffer("weights", weights)  # (S, C, D)
        self.register_buffer("biases", biases)  # (S, C) or None

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        self.backbone(x)
        phi = self.backbone.tapped(self.tap).float()
        logits = torch.einsum("nd,scd->snc", phi, self.weights)
        if self.biases is not None:
            logits = logits + self.biases.unsqueeze(1)
        if logits.shape[-1] == 1:
            logits = torch.cat([torch.zeros_like(logits), logits], -1)
        samples = torch.log_softmax(logits, -1)
        return log_mean_exp(samples), samples


# ---- calibration maps: logits (..., C) -> calibrated log-probabilities
class Identity(nn.Module):
    """``log_softmax(z)``."""

    def forward(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, -1)


class Temperature(nn.Module):
    """``log_softmax(z / T)``."""

    def __init__(self, temperature: Tensor) -> None:
        super().__init__()
        self.register_buffer("temperature", temperature)

    def forward(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits / cast(self.temperature, logits.dtype), -1)


class Affine(nn.Module):
    """``log_softmax`` of an affine map: ``"vector"`` ``z w + b``, ``"matrix"`` ``z Wᵀ + b``, ``"dirichlet"`` the
    matrix map of ``log_softmax(z)``, ``"platt"`` ``[0, (z_1 - z_0) a + b]``."""

    def __init__(self, kind: str, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, logits: Tensor) -> Tensor:
        weight, bias = cast(self.weight, logits.dtype), cast(self.bias, logits.dtype)
        if self.kind == "vector":
            mapped = logits * weight + bias
        elif self.kind == "platt":
            margin = logits[..., 1:] - logits[..., :1]
            mapped = torch.cat([torch.zeros_like(margin), margin * weight + bias], -1)
        else:
            features = torch.log_softmax(logits, -1) if self.kind == "dirichlet" else logits
            mapped = features @ weight.T + bias
        return torch.log_softmax(mapped, -1)


class TemperatureMixture(nn.Module):
    """Ensemble temperature scaling: ``log(w_1 softmax(z / T) + w_2 softmax(z) + w_3 / C)``."""

    def __init__(self, temperature: Tensor, weights: Tensor) -> None:
        super().__init__()
        self.register_buffer("temperature", temperature)
        self.register_buffer("weights", weights)

    def forward(self, logits: Tensor) -> Tensor:
        uniform = torch.full_like(logits, -math.log(logits.shape[-1]))
        parts = torch.stack(
            [
                torch.log_softmax(logits / cast(self.temperature, logits.dtype), -1),
                torch.log_softmax(logits, -1),
                uniform,
            ]
        )
        log_weights = cast(self.weights, logits.dtype).log().reshape(3, *([1] * logits.dim()))
        return torch.logsumexp(parts + log_weights, 0)


class Histogram(nn.Module):
    """Histogram binning: ``bins`` equal-width bins whose probability is a fitted frequency (``per-class`` or
    ``top-label``), rows renormalised."""

    def __init__(self, values: Tensor, bins: int, mode: str) -> None:
        super().__init__()
        self.bins, self.mode = bins, mode
        self.register_buffer("values", values)

    def bin_index(self, probs: Tensor) -> Tensor:
        return (probs * self.bins).long().clamp(0, self.bins - 1)

    def forward(self, logits: Tensor) -> Tensor:
        probs = torch.softmax(logits, -1)
        values = cast(self.values, probs.dtype)
        if self.mode == "top-label":
            confidence, predicted = probs.max(-1, keepdim=True)
            calibrated = values[0][self.bin_index(confidence)].clamp(BIN_FLOOR, 1 - BIN_FLOOR)
            rest = (probs / (1 - confidence).clamp_min(BIN_FLOOR)) * (1 - calibrated)
            mapped = rest.scatter(-1, predicted, calibrated)
        else:
            index = self.bin_index(probs)
            mapped = torch.gather(values.expand(*probs.shape[:-1], *values.shape), -1, index.unsqueeze(-1)).squeeze(-1)
        mapped = mapped.clamp_min(BIN_FLOOR)
        return (mapped / mapped.sum(-1, keepdim=True)).log()


class Isotonic(nn.Module):
    """One-vs-rest piecewise-linear isotonic maps of the class probabilities (in float64), rows renormalised.

    ``points`` and ``values`` ``(C, L)`` are padded; ``sizes[c]`` of them are class ``c``'s.
    """

    def __init__(self, points: Tensor, values: Tensor, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = [int(size) for size in sizes]
        self.register_buffer("points", points.double())
        self.register_buffer("values", values.double())

    def interpolate(self, x: Tensor, c: int) -> Tensor:
        size = self.sizes[c]
        points, values = self.points[c, :size], self.values[c, :size]
        if size == 1:
            return values.expand_as(x)
        right = (x.unsqueeze(-1) > points).sum(-1).clamp(1, size - 1)  # searchsorted, in plain ops
        x0, x1, y0, y1 = points[right - 1], points[right], values[right - 1], values[right]
        slope = torch.where(x1 > x0, (y1 - y0) / (x1 - x0).clamp_min(1e-300), torch.zeros_like(x1))
        return (y0 + slope * (x.clamp(points[0], points[-1]) - x0)).clamp(values[0], values[-1])

    def forward(self, logits: Tensor) -> Tensor:
        probs = torch.softmax(logits.double(), -1)
        mapped = torch.stack([self.interpolate(probs[..., c], c) for c in range(len(self.sizes))], -1)
        mapped = mapped.clamp_min(BIN_FLOOR)
        return cast((mapped / mapped.sum(-1, keepdim=True)).log(), logits.dtype)


class Calibrated(nn.Module):
    """A calibration map stacked on a predictive: per sample (then averaged) where ``per_sample`` and the inner
    predictive samples, else on its log-probabilities (floored at :data:`LOG_PROB_FLOOR`)."""

    def __init__(self, inner: nn.Module, calibration: nn.Module, per_sample: bool) -> None:
        super().__init__()
        self.inner, self.calibration, self.per_sample = inner, calibration, per_sample

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        log_probs, samples = self.inner(x)
        if samples is not None and self.per_sample:
            calibrated = self.calibration(samples.clamp_min(LOG_PROB_FLOOR))
            return log_mean_exp(calibrated), calibrated
        return self.calibration(log_probs.clamp_min(LOG_PROB_FLOOR)), None


class DensityTemperature(nn.Module):
    """Density-aware calibration: example ``i`` tempered by ``T(x) = T0 (1 + relu((log d(x) - a) / s) @ w)``, ``d_l``
    the distance of its unit-normalised features at layer ``l`` to the ``k``-th nearest row of that layer's bank."""

    def __init__(
        self,
        inner: nn.Module,
        backbone: Backbone,
        taps: list[int],
        banks: list[Tensor],
        k: int,
        anchors: Tensor,
        spreads: Tensor,
        temperature: Tensor,
        weights: Tensor,
    ) -> None:
        super().__init__()
        self.inner, self.backbone, self.taps, self.k = inner, backbone, list(taps), k
        for index, bank in enumerate(banks):
            self.register_buffer(f"bank{index}", bank)
        self.register_buffer("anchors", anchors)
        self.register_buffer("spreads", spreads)
        self.register_buffer("temperature", temperature)
        self.register_buffer("weights", weights)

    def log_distance(self, features: Tensor, bank: Tensor) -> Tensor:
        queries = pooled(features)
        queries = queries / queries.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        nearest = (cast(queries, bank.dtype) @ bank.T).topk(self.k, dim=1).indices[:, -1]
        distance = (queries.double() - bank[nearest].double()).square().sum(-1).sqrt()
        return distance.clamp_min(MIN_DISTANCE).log().float()

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        log_probs, samples = self.inner(x)
        banks = [getattr(self, f"bank{index}") for index in range(len(self.taps))]
        log_d = torch.stack(
            [self.log_distance(self.backbone.tapped(tap), bank) for tap, bank in zip(self.taps, banks)], 1
        )
        excess = ((log_d - self.anchors) / self.spreads).clamp_min(0)
        t = self.temperature * (1 + excess @ self.weights)
        if samples is not None:
            tempered = torch.log_softmax(samples.clamp_min(LOG_PROB_FLOOR) / cast(t, samples.dtype).view(1, -1, 1), -1)
            return log_mean_exp(tempered), tempered
        return torch.log_softmax(log_probs.clamp_min(LOG_PROB_FLOOR) / cast(t, log_probs.dtype).view(-1, 1), -1), None


class Mixture(nn.Module):
    """The equal-weight mixture of member predictives (an ensemble)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        parts = [member(x) for member in self.members]
        log_probs = log_mean_exp(torch.stack([part[0] for part in parts]))
        if all(part[1] is None for part in parts):
            return log_probs, torch.stack([part[0] for part in parts])
        count = max(part[1].shape[0] for part in parts if part[1] is not None)
        return log_probs, torch.cat(
            [part[0].unsqueeze(0).expand(count, -1, -1) if part[1] is None else part[1] for part in parts]
        )


class ExportedClassifier(nn.Module):
    """Inputs to predictive probabilities ``(N, C)`` (float32): the top of an exported classifier."""

    def __init__(self, predictive: nn.Module) -> None:
        super().__init__()
        self.predictive = predictive

    def forward(self, x: Any) -> Tensor:
        log_probs, _ = self.predictive(x)
        return torch.softmax(log_probs.float(), -1)


# ---------------------------------------------------------------------------------------------------- regression
class GaussianOutputs(nn.Module):
    """The network's outputs as a Gaussian: ``mean = f(x)``, ``variance = noise + model variance``.

    ``noise`` is a fitted observation variance (``None``: the network predicts it, outputs ``(N, 2D)`` means then
    log-variances); ``head`` (a :class:`HeadGaussian`, optional) adds last-layer Laplace's ``J Σ Jᵀ`` times
    ``noise``.
    """

    def __init__(self, backbone: Backbone, noise: Tensor | None, head: HeadGaussian | None = None) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head
        self.register_buffer("noise", noise)

    def forward(self, x: Any) -> tuple[Tensor, Tensor]:
        outputs = self.backbone(x)
        outputs = outputs[:, None] if outputs.dim() == 1 else outputs
        if self.noise is None:
            width = outputs.shape[-1] // 2
            return outputs[None, :, :width], outputs[None, :, width:].exp()
        variance = cast(self.noise, outputs.dtype).expand_as(outputs)
        if self.head is not None:
            dtype = torch.promote_types(outputs.dtype, torch.float32)
            phi_aug = cast(self.head.augmented(self.backbone.tapped(self.head.tap)), dtype)
            outputs, noise = cast(outputs, dtype), cast(self.noise, dtype)
            variance = noise * self.head.variance(phi_aug) + noise
        return outputs[None], variance[None]


class RegressionMixture(nn.Module):
    """The equal-weight mixture of member regression predictives (their components side by side)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: Any) -> tuple[Tensor, Tensor]:
        parts = [member(x) for member in self.members]
        return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])


class ExportedRegressor(nn.Module):
    """Inputs to the predictive ``(mean (N, D), variance (N, D))`` of a Gaussian mixture: the top of an exported
    regressor (the variance is the components' mean variance plus the spread of their means)."""

    def __init__(self, predictive: nn.Module) -> None:
        super().__init__()
        self.predictive = predictive

    def forward(self, x: Any) -> tuple[Tensor, Tensor]:
        means, variances = self.predictive(x)
        mean = means.mean(0)
        return mean, variances.mean(0) + (means - mean).square().mean(0)
