"""The shared pieces of an exported predictive: the network run once, stacking, mixtures and the top modules.

A *predictive* module returns ``(log_probs (N, C), samples (S, N, C) or None)`` (classification) or ``(means (K, N,
D), variances (K, N, D))`` (regression); the top modules turn that into probabilities, or a mean and a variance.
:class:`Backbone` runs the user's network once per call and keeps what its taps saw, so the pieces stacked on it share
one pass. A method's own piece is written next to its mathematics, in its folder; the pieces here know no method.

Example:
    >>> from posthoc.export.modules import Backbone, ExportedClassifier, Plain
    >>> import torch
    >>> from torch import nn
    >>> exported = ExportedClassifier(Plain(Backbone(nn.Sequential(nn.Linear(4, 3)))))
    >>> torch.allclose(exported(torch.randn(2, 4)).sum(-1), torch.ones(2))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import Gaussian, HeteroscedasticGaussian, Likelihood
from posthoc.core.logits import as_class_logits, class_log_probs, log_mean_exp, logits_of
from posthoc.errors import ExportError


def cast(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` in ``dtype``, with no cast at all where it is in it already (the TorchScript-based ONNX exporter
    writes a no-op cast of a buffer as a node without an input).

    Example:
        >>> import torch
        >>> from posthoc.export.modules import cast
        >>> cast(torch.ones(2), torch.float32).dtype, cast(torch.ones(2), torch.float64).dtype
        (torch.float32, torch.float64)
    """
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
    """The user's network, run once per call; ``taps`` keep the input or output of named modules (:meth:`tapped`).

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


class HeadSamples(nn.Module):
    """A linear head under ``S`` weight draws fixed at export: ``logits_s = phi @ W_sᵀ + b_s``; every input sees the
    same ``S`` draws (a method that samples its head's weights draws them, and hands them here)."""

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


class LogSoftmax(nn.Module):
    """The identity calibration map: ``log_softmax(z)``."""

    def forward(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, -1)


class FunctionMap(nn.Module):
    """A calibration map, class logits ``(..., C)`` to log-probabilities: ``function(logits, **buffers, **constants)``,
    the very function the calibrator applies in process, with its fitted tensors held as buffers.

    Example:
        >>> import torch
        >>> from posthoc.export.modules import FunctionMap
        >>> def tempered(logits, temperature):
        ...     return torch.log_softmax(logits / temperature, -1)
        >>> FunctionMap(tempered, {"temperature": torch.tensor(2.0)})(torch.zeros(1, 2)).exp()
        tensor([[0.5000, 0.5000]])
    """

    def __init__(
        self, function: Callable[..., Tensor], tensors: dict[str, Tensor], constants: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.function, self.names, self.constants = function, list(tensors), dict(constants or {})
        for name, value in tensors.items():
            self.register_buffer(name, value.detach().clone())

    def forward(self, logits: Tensor) -> Tensor:
        return self.function(logits, **{name: getattr(self, name) for name in self.names}, **self.constants)


class LogitsIn(nn.Module):
    """A calibration map as a predictive of logits (a binary classifier's one logit read as ``[0, z]``)."""

    def __init__(self, calibration: nn.Module) -> None:
        super().__init__()
        self.calibration = calibration

    def forward(self, logits: Tensor) -> tuple[Tensor, None]:
        return self.calibration(as_class_logits(logits).float()), None


class ExportedClassifier(nn.Module):
    """Inputs to predictive probabilities ``(N, C)`` (float32): the top of an exported classifier."""

    def __init__(self, predictive: nn.Module) -> None:
        super().__init__()
        self.predictive = predictive

    def forward(self, x: Any) -> Tensor:
        log_probs, _ = self.predictive(x)
        return torch.softmax(log_probs.float(), -1)


class ExportedPositions(nn.Module):
    """Inputs to per-position probabilities shaped like the logits, ``(N, C, *P)`` (tokens ``(N, T, V)``): the top of
    an exported dense classifier. ``classifier`` gives the rows ``(N·P, C)`` of a row model (``posthoc.engine.dense.
    PositionRows``) that ``backbone`` runs and that keeps the ``positions`` ``(N, *P)`` of its last call; ``key`` is
    the input's name in the row model's inputs (``None``: the inputs are a dict already)."""

    def __init__(self, classifier: nn.Module, backbone: Backbone, class_dim: int, key: str | None) -> None:
        super().__init__()
        self.classifier, self.backbone, self.class_dim, self.key = classifier, backbone, class_dim, key

    def forward(self, x: Any) -> Tensor:
        probs = self.classifier(x if self.key is None else {self.key: x})
        return probs.reshape(*self.backbone.model.positions, probs.shape[-1]).movedim(-1, self.class_dim)


# ---------------------------------------------------------------------------------------------------- regression
def observation_variance(likelihood: Likelihood) -> Tensor | None:
    """The fitted observation variance of a Gaussian likelihood, ``()`` or one per output ``(D,)`` (``None``: the
    network predicts it); other likelihoods have no exported form.

    Example:
        >>> from posthoc.export.modules import observation_variance
        >>> from posthoc.core.likelihood import Gaussian
        >>> observation_variance(Gaussian(noise_std=0.5))
        tensor(0.2500)
    """
    if isinstance(likelihood, HeteroscedasticGaussian):
        return None
    if isinstance(likelihood, Gaussian) and likelihood.per_output:
        return likelihood.fitted_stds().square().to(torch.float32)
    if isinstance(likelihood, Gaussian):
        return torch.tensor(likelihood.dispersion, dtype=torch.float32)
    raise ExportError(
        f"um.to_module() exports the regression likelihoods 'regression' and 'heteroscedastic', not '{likelihood.name}'"
    )


class GaussianOutputs(nn.Module):
    """The network's outputs as a Gaussian: ``mean = f(x)``, ``variance = noise + model variance``.

    ``noise`` is a fitted observation variance (``None``: the network predicts it); ``spread`` (optional) is a module
    whose ``unit_variance(outputs)`` gives the variance of ``f(x)`` per unit of noise (a last-layer posterior).
    """

    def __init__(self, backbone: Backbone, noise: Tensor | None, spread: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone, self.spread = backbone, spread
        self.register_buffer("noise", noise)

    def forward(self, x: Any) -> tuple[Tensor, Tensor]:
        outputs = self.backbone(x)
        outputs = outputs[:, None] if outputs.dim() == 1 else outputs
        if self.noise is None:
            width = outputs.shape[-1] // 2
            return outputs[None, :, :width], outputs[None, :, width:].exp()
        variance = cast(self.noise, outputs.dtype).expand_as(outputs)
        if self.spread is not None:
            dtype = torch.promote_types(outputs.dtype, torch.float32)
            outputs, noise = cast(outputs, dtype), cast(self.noise, dtype)
            variance = noise * self.spread.unit_variance(outputs) + noise
        return outputs[None], variance[None]


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
