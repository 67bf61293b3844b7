"""Building the exported module of a fitted predictive: one converter per method, reading its fitted buffers.

Each converter turns one method of a chain into a predictive module of :mod:`posthoc.export.modules` (plain torch,
the fitted constants copied into buffers). What a converter reads of a method goes through the small accessors
below (``_laplace_*``, ``_dac_*``, ...), so that a change to a method's internals touches one function here.

A method that cannot be written as plain tensor operations on the network's output raises
:class:`~posthoc.errors.ExportError`, saying why and what to do instead.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import posthoc
    >>> from posthoc.export.build import to_module
    >>> um = posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="none")
    >>> module = to_module(um)
    >>> module(torch.randn(2, 4)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian
from posthoc.core.method import Method, chain_of
from posthoc.engine.head import FeatureSplit
from posthoc.errors import ExportError, HeadNotFoundError, NotFittedError
from posthoc.export import modules as plain
from posthoc.methods.mc_dropout.masks import keep_mask, keep_probability

#: weight draws of an exported sampling predictive when neither ``num_samples`` nor the method says
DEFAULT_SAMPLES = 100
#: what every refusal suggests
IN_PROCESS = (
    "serve it in process with um.predict (or um(x)) instead, or export a method listed in docs/serving-export.md"
)


class Builder:
    """Converts the methods of one fitted predictive; shares one :class:`~posthoc.export.modules.Backbone` per network
    so that a method stacked on another (DAC) reads the same forward pass.

    Args:
        num_samples: weight draws for the predictives exported with fixed samples (``None``: each method's own).
        seed: seeds the draws made at export.
    """

    def __init__(self, num_samples: int | None = None, seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed
        self._backbones: dict[int, plain.Backbone] = {}

    def backbone(self, model: nn.Module) -> plain.Backbone:
        """The exported copy of ``model`` (in eval mode), one per network."""
        if id(model) not in self._backbones:
            self._backbones[id(model)] = plain.Backbone(copy.deepcopy(model).eval().requires_grad_(False))
        return self._backbones[id(model)]

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def samples_of(self, method: Method) -> int:
        return int(self.num_samples or getattr(method, "num_samples", None) or DEFAULT_SAMPLES)

    def classifier(self, method: Method) -> nn.Module:
        """The predictive module ``(log_probs, samples)`` of ``method`` (and the methods it stacks on)."""
        for cls in type(method).__mro__:
            convert = CLASSIFIERS.get(cls.__name__)
            if convert is not None:
                return convert(self, method)
        raise _refusal(method)

    def regressor(self, method: Method) -> nn.Module:
        """The predictive module ``(means (K, N, D), variances (K, N, D))`` of ``method`` (a regression likelihood)."""
        for cls in type(method).__mro__:
            convert = REGRESSORS.get(cls.__name__)
            if convert is not None:
                return convert(self, method)
        raise _refusal(method, regression=True)


def to_module(um: Any, *, num_samples: int | None = None, seed: int = 0) -> nn.Module:
    """The fitted predictive of ``um`` as a self-contained ``nn.Module`` (see ``UncertainModel.to_module``)."""
    classification = isinstance(um.likelihood, Categorical)
    check_exportable(um.method, regression=not classification)
    if um.method.requires_fit and not um.is_fitted:
        raise NotFittedError(
            "um.to_module() exports the fitted predictive: call um.fit(train_loader, val_loader) first"
        )
    um.method.follow_model_device()
    builder = Builder(num_samples, seed)
    if classification:
        exported: nn.Module = plain.ExportedClassifier(builder.classifier(um.method))
    else:
        exported = plain.ExportedRegressor(builder.regressor(um.method))
    return exported.to(um.device).eval()  # the draws made on the CPU join the network on its device


def calibrator_module(calibrator: Any) -> nn.Module:
    """A fitted calibrator of ``posthoc.calibrate`` as a module from class logits ``(N, C)`` to probabilities."""
    return plain.ExportedClassifier(_LogitsIn(calibration_map(calibrator))).eval()


class _LogitsIn(nn.Module):
    """A calibration map as a predictive of logits (a binary classifier's one logit read as ``[0, z]``)."""

    def __init__(self, calibration: nn.Module) -> None:
        super().__init__()
        self.calibration = calibration

    def forward(self, logits: Tensor) -> tuple[Tensor, None]:
        return self.calibration(plain.class_logits(logits).float()), None


def _refusal(method: Method, *, regression: bool = False) -> ExportError:
    task = " under a regression likelihood" if regression else ""
    why = REASONS.get(
        type(method).__name__,
        SAMPLES_NETWORKS if type(method).__name__ in NETWORK_SAMPLERS else f"it has no exported form{task} yet",
    )
    return ExportError(f"um.to_module() cannot export '{method.name}'{task}: {why}; {IN_PROCESS}")


#: methods whose samples are whole networks (weights inside it, or a noise on its inner nodes)
NETWORK_SAMPLERS = ("ImplicitBNN", "IVON", "SGLD", "SparseVariationalDropout", "VariationalInference")
SAMPLES_NETWORKS = (
    "its samples are networks with their inner weights or nodes perturbed, which need the network run "
    "once per sample (no fixed tensor program on the head's input)"
)


#: why a method cannot be exported, by class name
REASONS = {
    "SubsetLaplace": "Laplace over layers inside the network linearises the whole network in those layers (a Jacobian "
    "per input), which is no fixed tensor program; refit with subset='last_layer' to export it",
    "SWAG": "SWAG over the network's layers samples whole networks (and their BatchNorm statistics); use "
    "subset='last_layer' to export it with weight draws fixed at export",
    "SubsetSWAG": "SWAG over named layers samples whole networks (and their BatchNorm statistics); use "
    "subset='last_layer' to export it with weight draws fixed at export",
    "QuantileRecalibration": "a regression calibrator of the predictive CDF has no mean-and-variance form",
}


# ---------------------------------------------------------------------------------------------------- accessors
def _laplace_head(method: Method) -> tuple[str, nn.Linear, bool]:
    """``(head name, head, has bias)`` of last-layer Laplace."""
    split: FeatureSplit = method.split
    if split.head is None:
        raise ExportError("the head of this model was not found yet: run um.predict on one batch before um.to_module()")
    return split.head_name, split.head, split.head.bias is not None


def _laplace_prior_precision(method: Method) -> float:
    method._settle()
    return float(method.prior_precision)


def _laplace_structure(method: Method) -> tuple[str, nn.Module]:
    block = method.curvature
    return {"DiagCurvature": "diag", "KronCurvature": "kron", "FullCurvature": "full"}[type(block).__name__], block


def _head_factors(method: Method, prior_precision: float) -> dict[str, Tensor]:
    """The posterior of last-layer Laplace at ``prior_precision`` folded into what the logits' variance reads."""
    structure, block = _laplace_structure(method)
    if structure == "diag":
        return {"inverse": (1.0 / (block.diagonal + prior_precision)).T.float().clone()}
    if structure == "kron":
        inverse = torch.outer(block.in_eigvals, block.out_eigvals).add(prior_precision).reciprocal()
        return {
            "in_eigvecs": block.in_eigvecs.float().clone(),
            "inverse": inverse.float(),
            "out_eigvecs": block.out_eigvecs.float().clone(),
        }
    _, head, bias = _laplace_head(method)
    width = head.in_features + int(bias)
    vectors, spread = block._diagonal_blocks(prior_precision, head.out_features, width, torch.float32)
    return {"vectors": vectors.clone(), "spread": spread.clone()}


def _head_weights(head: nn.Linear) -> Tensor:
    """The head's ``[W, b]`` ``(C, D+1)`` (``W`` alone without a bias), as Laplace orders its parameters."""
    weight = head.weight.detach().float()
    return weight if head.bias is None else torch.cat([weight, head.bias.detach().float()[:, None]], 1)


def _dac_state(method: Method) -> dict[str, Any]:
    """DAC's layers, banks and fitted temperature map."""
    if method.bank is None or method.weights is None:
        raise NotFittedError("dac is not fitted: call um.fit(train_loader, val_loader) first")
    return {
        "sites": [(site.name, site.at) for site in method.sites()],
        "banks": [bank.float().clone() for bank in method._banks()],
        "k": min(method.k, method.bank_rows),
        "anchors": method.anchors.float().clone(),
        "spreads": method.spreads.float().clone(),
        "temperature": method.temperature.float().clone(),
        "weights": method.weights.float().clone(),
    }


def _dropout_site(method: Method) -> Any:
    """MC dropout's one site, or an :class:`ExportError` for several (or for sites not resolved yet)."""
    method._resolve(None)
    if method._sites is None:
        raise ExportError(
            "mc-dropout has not seen an input yet (its dropout sites are found on the first batch): run "
            "um.predict on one batch before um.to_module()"
        )
    sites = method.sites()
    if len(sites) != 1:
        raise ExportError(
            f"um.to_module() exports mc-dropout with dropout on the head's input only (masks fixed at "
            f"export); this one drops at {len(sites)} sites ({', '.join(s.name for s in sites)}), whose "
            f"samples need the network run per sample. Wrap with where='head' to export it; {IN_PROCESS}"
        )
    return sites[0]


def _dropout_head(method: Method, site: Any) -> tuple[str, nn.Linear]:
    """The Linear head whose input is exactly what MC dropout's one site drops (checked on the module structure)."""
    model = method.model
    try:
        split = FeatureSplit(model, site.name if site.at == "input" else method.head)
    except HeadNotFoundError as err:  # a head that cannot be found without an input, or is not Linear
        raise ExportError(
            f"mc-dropout's head could not be found for export ({err}); pass head=... to posthoc.wrap"
        ) from err
    if split.head is not None:
        module = model.get_submodule(site.name)
        if site.at == "input" and module is split.head:
            return split.head_name, split.head
        parent_name, _, child = site.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if site.at == "output" and isinstance(parent, nn.Sequential):
            names = [name for name, _ in parent.named_children()]
            following = names.index(child) + 1
            if following < len(names) and parent[following] is split.head:
                return split.head_name, split.head
    raise ExportError(
        f"mc-dropout drops at '{site.name}' ({site.at}), which is not the input of a Linear head, so its "
        f"samples need the network run per sample; wrap with where='head' (or name the head's input) to "
        f"export it; {IN_PROCESS}"
    )


def _dropout_rate(site: Any) -> float:
    return float(site.p)


def _swag_moments(method: Method) -> tuple[Tensor, Tensor, Tensor | None, float]:
    """Last-layer SWAG's ``(mean (P,), variance (P,), deviations (K, P) or None, scale)``."""
    collector = method.collector
    if collector is None:
        raise NotFittedError("swag is not fitted: call um.fit(train_loader) first")
    deviations = collector.held_deviations if method.cov else None
    return (
        collector.mean.float().cpu(),
        collector.variance.float().cpu(),
        None if deviations is None else deviations.float().cpu(),
        float(method.scale),
    )


# ---------------------------------------------------------------------------------------------------- classifiers
def _plain(builder: Builder, method: Method) -> nn.Module:
    return plain.Plain(builder.backbone(method.model))


def _laplace(builder: Builder, method: Method) -> nn.Module:
    head_name, head, bias = _laplace_head(method)
    prior_precision = _laplace_prior_precision(method)
    structure, block = _laplace_structure(method)
    backbone = builder.backbone(method.model)
    tap = backbone.add_tap(head_name, "input")
    if method.link == "mc":
        value = _head_weights(head)
        draws = block.sample(value, prior_precision, builder.samples_of(method), builder.generator()).float()
        return plain.HeadGaussian(backbone, tap, structure, "samples", bias, {}, draws)
    if method.link == "bridge" and structure == "full":
        raise ExportError(
            "um.to_module() exports the Laplace bridge for hessian='diag' and 'kron' (hessian='full' "
            "needs "
            "each input's C x C covariance); wrap with link='probit' or link='mc' to export it"
        )
    return plain.HeadGaussian(backbone, tap, structure, method.link, bias, _head_factors(method, prior_precision))


def _calibration(builder: Builder, method: Method) -> nn.Module:
    return plain.Calibrated(
        builder.classifier(method.inner), calibration_map(method.calibrator), bool(method.calibrator.per_sample)
    )


def calibration_map(calibrator: Any) -> nn.Module:
    """The module of a fitted calibrator's map, class logits ``(..., C)`` to calibrated log-probabilities."""
    if bool(calibrator.passthrough):
        return plain.Identity()
    name = type(calibrator).__name__
    if name == "AutoCalibration":
        return calibration_map(calibrator.chosen)
    if name == "Identity":
        return plain.Identity()
    if name == "TemperatureCalibrator":
        return plain.Temperature(calibrator.temperature.float().clone())
    if name in ("VectorScaling", "MatrixScaling", "DirichletCalibration", "PlattScaling"):
        return plain.Affine(calibrator.name, calibrator.weight.float().clone(), calibrator.bias.float().clone())
    if name == "EnsembleTemperatureScaling":
        return plain.TemperatureMixture(calibrator.temperature.float().clone(), calibrator.weights.float().clone())
    if name == "HistogramBinning":
        return plain.Histogram(calibrator.values.float().clone(), calibrator.bins, calibrator.mode)
    if name == "IsotonicCalibration":
        return plain.Isotonic(calibrator.points.clone(), calibrator.values.clone(), calibrator.sizes.tolist())
    raise ExportError(f"the calibrator '{calibrator.name}' ({name}) has no exported form yet; {IN_PROCESS}")


def _dac(builder: Builder, method: Method) -> nn.Module:
    state = _dac_state(method)
    inner = builder.classifier(method.inner)
    backbone = builder.backbone(method.base_model)
    taps = [backbone.add_tap(name, at) for name, at in state["sites"]]
    return plain.DensityTemperature(
        inner,
        backbone,
        taps,
        state["banks"],
        state["k"],
        state["anchors"],
        state["spreads"],
        state["temperature"],
        state["weights"],
    )


def _ensemble(builder: Builder, method: Method) -> nn.Module:
    return plain.Mixture([builder.classifier(member) for member in method.members])


def _auto(builder: Builder, method: Method) -> nn.Module:
    return builder.classifier(method._chosen())


def _mc_dropout(builder: Builder, method: Method) -> nn.Module:
    site = _dropout_site(method)
    if _dropout_rate(site) == 0:
        return _plain(builder, method)
    head_name, head = _dropout_head(method, site)
    p = _dropout_rate(site)
    keep = keep_mask((builder.samples_of(method), head.in_features), p, generator=builder.generator(), device="cpu")
    scale = keep.float() / keep_probability(p)
    weights = head.weight.detach().float().cpu() * scale[:, None, :]
    biases = None if head.bias is None else head.bias.detach().float().cpu().expand(scale.shape[0], -1).clone()
    backbone = builder.backbone(method.model)
    return plain.HeadSamples(backbone, backbone.add_tap(head_name, "input"), weights, biases)


def _swag_last_layer(builder: Builder, method: Method) -> nn.Module:
    mean, variance, deviations, scale = _swag_moments(method)
    head, head_name = method.split.head, method.split.head_name
    count = builder.samples_of(method) if scale > 0 else 1
    generator = builder.generator()
    noise = torch.randn(count, mean.numel(), generator=generator) * variance.clamp_min(0).sqrt()
    if deviations is not None and scale > 0:
        low_rank = torch.randn(count, deviations.shape[0], generator=generator) @ deviations
        noise = noise + low_rank / math.sqrt(deviations.shape[0] - 1)
    flat = mean + math.sqrt(scale) * noise
    size = head.out_features * head.in_features
    weights = flat[:, :size].reshape(count, head.out_features, head.in_features)
    if flat.shape[1] > size:
        biases = flat[:, size:]
    else:
        biases = None if head.bias is None else head.bias.detach().float().cpu().expand(count, -1).clone()
    backbone = builder.backbone(method.model)
    return plain.HeadSamples(backbone, backbone.add_tap(head_name, "input"), weights.clone(), biases)


def _variational_moments(method: Method) -> tuple[str, Tensor, Tensor, Tensor | None, Tensor | None]:
    """A head-only variational posterior's ``(head name, weight mean, weight variance, bias mean, bias variance)``."""
    name = method.split.head_name
    weight_mean, weight_var, bias_mean, bias_var = method.layers[name].moments()
    detached = [None if t is None else t.detach().float().cpu() for t in (weight_mean, weight_var, bias_mean, bias_var)]
    return (name, *detached)


def _variational_head(builder: Builder, method: Method) -> nn.Module:
    """VI or sparse VD over the head (``layers="head"``): ``S`` head weights drawn from the mean-field Gaussian."""
    if method.split is None:
        raise _refusal(method)
    name, weight_mean, weight_var, bias_mean, bias_var = _variational_moments(method)
    count, generator = builder.samples_of(method), builder.generator()
    weights = weight_mean + weight_var.clamp_min(0).sqrt() * torch.randn(count, *weight_mean.shape, generator=generator)
    biases = None
    if bias_mean is not None:
        biases = bias_mean.expand(count, -1).clone()
        if bias_var is not None:
            biases = biases + bias_var.clamp_min(0).sqrt() * torch.randn(count, *bias_mean.shape, generator=generator)
    backbone = builder.backbone(method.model)
    return plain.HeadSamples(backbone, backbone.add_tap(name, "input"), weights, biases)


#: converters of classifiers, by method class name (the first class of a method's MRO found here converts it)
CLASSIFIERS: dict[str, Callable[[Builder, Method], nn.Module]] = {
    "PlainModel": _plain,
    "LastLayerLaplace": _laplace,
    "CalibrationMethod": _calibration,
    "DensityAwareCalibration": _dac,
    "Ensemble": _ensemble,
    "AutoMethod": _auto,
    "MCDropout": _mc_dropout,
    "LastLayerSWAG": _swag_last_layer,
    "VariationalMethod": _variational_head,
}


# ---------------------------------------------------------------------------------------------------- regressors
def _noise(method: Method) -> Tensor | None:
    """The fitted observation variance of a Gaussian likelihood, ``()`` or one per output ``(D,)`` (``None``: the network
    predicts it)."""
    likelihood = method.likelihood
    if isinstance(likelihood, HeteroscedasticGaussian):
        return None
    if isinstance(likelihood, Gaussian) and likelihood.per_output:
        return likelihood.fitted_stds().square().to(torch.float32)
    if isinstance(likelihood, Gaussian):
        return torch.tensor(likelihood.dispersion, dtype=torch.float32)
    raise ExportError(
        f"um.to_module() exports the regression likelihoods 'regression' and 'heteroscedastic', not '{likelihood.name}'"
    )


def _plain_regressor(builder: Builder, method: Method) -> nn.Module:
    return plain.GaussianOutputs(builder.backbone(method.model), _noise(method))


def _laplace_regressor(builder: Builder, method: Method) -> nn.Module:
    head_name, _, bias = _laplace_head(method)
    noise = _noise(method)
    if noise is None:
        raise ExportError("last-layer Laplace exports under likelihood='regression' (a fitted noise) only")
    if noise.dim() > 0:
        raise ExportError(
            f"last-layer Laplace exports one observation noise shared by the outputs; this one has a noise "
            f"per output ({noise.numel()} values): export method='none' or an ensemble, or fit with "
            "likelihood=posthoc.Gaussian(noise_std=<one float>)"
        )
    structure, _ = _laplace_structure(method)
    backbone = builder.backbone(method.model)
    tap = backbone.add_tap(head_name, "input")
    factors = _head_factors(method, _laplace_prior_precision(method) * float(noise))
    head = plain.HeadGaussian(backbone, tap, structure, "probit", bias, factors)
    return plain.GaussianOutputs(backbone, noise, head)


def _ensemble_regressor(builder: Builder, method: Method) -> nn.Module:
    return plain.RegressionMixture([builder.regressor(member) for member in method.members])


def _auto_regressor(builder: Builder, method: Method) -> nn.Module:
    return builder.regressor(method._chosen())


REGRESSORS: dict[str, Callable[[Builder, Method], nn.Module]] = {
    "PlainModel": _plain_regressor,
    "LastLayerLaplace": _laplace_regressor,
    "Ensemble": _ensemble_regressor,
    "AutoMethod": _auto_regressor,
}


def _samples_layers(method: Method) -> bool:
    """Whether a variational method covers layers inside the network (not the head alone)."""
    return any(cls.__name__ == "VariationalMethod" for cls in type(method).__mro__) and method.split is None


def check_exportable(method: Method, *, regression: bool = False) -> None:
    """Refuse, before anything fitted is read, a chain (or ensemble member) with a method that has no converter.

    Example:
        >>> from torch import nn
        >>> import posthoc
        >>> from posthoc.export.build import check_exportable
        >>> try:
        ...     check_exportable(posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="vi", layers="all").method)
        ... except posthoc.ExportError as err:
        ...     print(str(err)[:40])
        um.to_module() cannot export 'vi': its s
    """
    table = REGRESSORS if regression else CLASSIFIERS
    for member in chain_of(method):
        if not any(cls.__name__ in table for cls in type(member).__mro__) or _samples_layers(member):
            raise _refusal(member, regression=regression)
        for inner in getattr(member, "members", None) or []:
            check_exportable(inner, regression=regression)
