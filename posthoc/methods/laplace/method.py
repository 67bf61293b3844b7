"""``"laplace"``: a Laplace approximation around the checkpoint, with a linearised predictive.

Last layer (``subset="last_layer"``, the default): the head's GGN is computed in closed form from
ONE pass over the training data (features and probabilities, no backward through the backbone;
see :mod:`posthoc.methods.laplace.curvature`), the prior precision is tuned by the marginal likelihood from the
GGN spectrum (:mod:`posthoc.methods.laplace.marglik`), and predictions are Gaussian in logit space
(:mod:`posthoc.methods.laplace.glm_predictive`): ``probit`` (default), ``mc`` samples or the Laplace ``bridge``.

More layers (``subset="all"`` or a list of module names): KFAC/diagonal GGN from BackPACK
(:mod:`posthoc.methods.laplace.curvature`) and, when every covered layer is Linear, the same logit-space GLM
predictive (:mod:`posthoc.methods.laplace.subset_glm`); otherwise, or with ``pred="nn"``, weight samples run
through the network.

Example:
    >>> um = posthoc.wrap(model, method="laplace", hessian="kron").fit(train_loader)
    >>> float(um.method.prior_precision) > 0
    True
    >>> um.predict(x).probs.shape
    torch.Size([8, 10])
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.core import settings
from posthoc.methods.laplace import subset_glm
from posthoc.core.registry import register
from posthoc.core.method import LogPredictive, Method
from posthoc.core.inputs import Inputs, batch_size, check_labels, iterate, run_model, slice_inputs
from posthoc.core.logits import class_log_probs
from posthoc.methods.laplace.curvature import STRUCTURES, SUBSET_STRUCTURES, LastLayerGGN, ParamCurvature, augment, backpack_ggn, check_memory, ggn_spectrum, num_params, sample_weights, subset_parameters
from posthoc.core.errors import ConfigError, InputError
from posthoc.methods.laplace.marglik import grid_search, log_marginal_likelihood, optimize_prior_precision
from posthoc.engine.head import FeatureSplit
from posthoc.core.modules import eval_mode, parameter_owners

PRIOR_MODES = ("marglik", "grid")
#: per-parameter buffers of a deeper (BackPACK) Laplace, named ``p{index}_{field}``
BLOCK_FIELDS = {
    "kron": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "kron-mc": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "diag": ("diagonal",),
}
#: buffers that hold each structure's fitted curvature
CURVATURE_BUFFERS = {
    "kron": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "full": ("eigvals", "eigvecs"),
    "diag": ("diagonal",),
}


@register
class Laplace(Method):
    """Laplace approximation of a trained classifier (see module docs).

    Options:
        hessian: ``"kron"`` (KFAC, default), ``"full"`` or ``"diag"`` GGN; for deeper subsets
            ``"kron"`` is BackPACK's exact KFLR, ``"kron-mc"`` its MC-sampled KFAC, ``"diag"`` DiagGGN.
        subset: ``"last_layer"`` (default), ``"all"``, or a list of module names (BackPACK KFAC).
        prior_precision: ``"marglik"`` (default: maximise the Laplace evidence), ``"grid"``
            (lowest validation NLL on a log grid; needs ``val_loader``), or a positive float.
        link: ``"probit"`` (default, deterministic), ``"mc"`` (logit samples) or ``"bridge"``.
        pred: ``"glm"`` (linearised; the default for the last layer and for subsets of Linear
            layers) or ``"nn"`` (weight samples through the network; the default for subsets
            with Conv2d layers).
        num_samples: samples for ``link="mc"`` and ``pred="nn"``.
        head: name of the classifier head, if it cannot be found automatically.
        max_memory: bytes for the posterior matrices and for one chunk of the predictive's
            temporaries (``None``: ``posthoc.settings.max_memory`` at call time).
    """

    name = "laplace"
    demo_configs = (
        ("LLLA kron", {"hessian": "kron"}),
        ("LLLA full", {"hessian": "full"}),
        ("LLLA diag", {"hessian": "diag"}),
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        hessian: str = "kron",
        subset: str | list[str] = "last_layer",
        prior_precision: str | float = "marglik",
        link: str = "probit",
        pred: str | None = None,
        num_samples: int = 100,
        head: str | None = None,
        max_memory: int | None = None,
    ) -> None:
        super().__init__(model)
        last_layer = subset == "last_layer"
        _check_options(hessian, subset, prior_precision, link, pred or "glm", num_samples, max_memory)
        self.hessian, self.subset, self.link, self.pred = hessian, subset, link, pred or "glm"
        self.prior_mode = prior_precision if isinstance(prior_precision, str) else "fixed"
        self.num_samples, self.max_memory = num_samples, max_memory
        initial = float(prior_precision) if self.prior_mode == "fixed" else 1.0
        self.register_buffer("prior_precision", torch.tensor(initial, dtype=torch.float64))
        self.register_buffer("train_loss", torch.zeros((), dtype=torch.float64))
        self.register_buffer("square_norm", torch.zeros((), dtype=torch.float64))
        if last_layer:
            self.split = FeatureSplit(model, head)
            if self.split.head is not None:
                self._check_head_memory()
            for name in CURVATURE_BUFFERS[hessian]:
                self.register_buffer(name, None)
        else:
            self.param_names = subset_parameters(model, subset)
            all_linear = all(isinstance(m, nn.Linear) for m in parameter_owners(model, self.param_names).values())
            self.pred = pred or ("glm" if all_linear else "nn")
            self.glm_layers = subset_glm.covered_linear_layers(model, self.param_names) if self.pred == "glm" else {}
            for index in range(len(self.param_names)):
                for field in BLOCK_FIELDS[hessian]:
                    self.register_buffer(f"p{index}_{field}", None)

    # ----------------------------------------------------------------------------------- fit
    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        if self.prior_mode == "grid" and val_loader is None:
            raise InputError(
                "prior_precision='grid' picks the prior by validation NLL: call "
                "um.fit(train_loader, val_loader) with held-out data, or use prior_precision='marglik'"
            )
        if self.subset == "last_layer":
            curvature = self._last_layer_curvature(train_loader, progress)
            for name in CURVATURE_BUFFERS[self.hessian]:
                setattr(self, name, getattr(curvature, name))
            head = self.split.head
            weights = [head.weight] + ([head.bias] if head.bias is not None else [])
            loss = curvature.loss
        else:
            loss = self._subset_curvature(train_loader, progress)
            params = dict(self.model.named_parameters())
            weights = [params[name] for name in self.param_names]
        self.train_loss.fill_(float(loss))
        self.square_norm.fill_(sum(float(w.detach().double().square().sum()) for w in weights))
        if self.prior_mode == "marglik":
            value = optimize_prior_precision(self.spectrum(), self.train_loss, self.square_norm)
            self.prior_precision.fill_(value)
        elif self.prior_mode == "grid":
            self.prior_precision.fill_(self._grid_prior_precision(val_loader, progress))

    def _last_layer_curvature(self, train_loader: Iterable, progress: bool):
        accumulator: LastLayerGGN | None = None
        device = self.device
        with torch.no_grad(), eval_mode(self.model):
            for x, y in iterate(train_loader, device=device, progress=progress, desc="laplace curvature"):
                phi, logits = self.split(x)
                if accumulator is None:
                    if logits.shape[1] < 2:
                        raise ConfigError(
                            "laplace uses the softmax (categorical) likelihood and needs a head with at least 2 "
                            "outputs; this head has 1 (a sigmoid classifier). Give the head two outputs "
                            "[0, z], or use 'temperature', 'mc-dropout' or 'swag', which handle one logit"
                        )
                    self._check_head_memory()
                    accumulator = LastLayerGGN(self.hessian, phi.shape[1], logits.shape[1], self._has_bias, device)
                accumulator.update(phi, logits, _labels(y, logits))
        params = num_params(self.split.head.in_features, self.split.head.out_features, self._has_bias)
        rank = accumulator.num_data * (self.split.head.out_features - 1)
        if rank < params:
            warnings.warn(
                f"{accumulator.num_data} training examples determine at most {rank} of the head's "
                f"{params} parameter directions: the curvature is singular and the posterior there is "
                "the prior (kept proper by prior_precision). Fit on more data for a data-driven posterior",
                RuntimeWarning,
                stacklevel=4,
            )
        return accumulator.finalize()

    def _subset_curvature(self, train_loader: Iterable, progress: bool) -> Tensor:
        device = self.device
        num_classes: list[int] = []

        def batches():
            for x, y in iterate(train_loader, device=device, progress=progress, desc="laplace curvature (BackPACK)"):
                if not isinstance(x, Tensor):
                    raise InputError("subset Laplace (BackPACK) needs tensor inputs, not a dict")
                if not num_classes:
                    with torch.no_grad(), eval_mode(self.model):
                        num_classes.append(self.model(x[:1]).shape[-1])
                yield x, _labels(y, (x.shape[0], num_classes[0]))

        blocks, loss = backpack_ggn(self.model, self.param_names, self.hessian, batches())
        for index, block in enumerate(blocks):
            for field in BLOCK_FIELDS[self.hessian]:
                setattr(self, f"p{index}_{field}", getattr(block, field))
        return loss

    def _blocks(self) -> list[ParamCurvature]:
        return [
            ParamCurvature(name, **{field: getattr(self, f"p{index}_{field}") for field in BLOCK_FIELDS[self.hessian]})
            for index, name in enumerate(self.param_names)
        ]

    def _grid_prior_precision(self, val_loader: Iterable, progress: bool) -> float:
        cached = []
        with torch.no_grad(), eval_mode(self.model):
            for x, y in iterate(val_loader, device=self.device, progress=progress, desc="laplace grid"):
                if self.subset == "last_layer":
                    phi, logits = self.split(x)
                    cached.append(((phi, logits), _labels(y, logits)))
                else:
                    cached.append((x, _labels(y, self.model(x))))

        def validation_nll(prior_precision: float) -> float:
            total, count = 0.0, 0
            generator = torch.Generator(device=self.device).manual_seed(0)
            for inputs, labels in cached:
                if self.subset == "last_layer":
                    log_probs, _ = self._log_predictive_features(*inputs, prior_precision, generator)
                else:
                    log_probs, _ = self._subset_predictive(inputs, prior_precision, generator, self.num_samples)
                total += float(torch.nn.functional.nll_loss(log_probs, labels, reduction="sum"))
                count += labels.numel()
            total, count = distributed.all_reduce_sum(torch.tensor([total, count], dtype=torch.float64)).tolist()
            return total / count

        with torch.no_grad(), eval_mode(self.model):
            return grid_search(validation_nll)

    # ------------------------------------------------------------------------------ predict
    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        if self.subset != "last_layer":
            return self._subset_predictive(x, float(self.prior_precision), generator, num_samples or self.num_samples)
        phi, logits = self.split(x)
        return self._log_predictive_features(phi, logits, float(self.prior_precision), generator, num_samples)

    def _subset_predictive(self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        if self.pred == "nn":
            return self._weight_space_predictive(x, prior_precision, generator, num_samples)
        # a one-row chunk tells the class count; later chunks keep the GLM temporaries under the budget
        blocks, total, start, step = self._blocks(), batch_size(x), 0, 1
        log_probs, sample_log_probs = [], []
        while start < total:
            gaussian = subset_glm.logit_gaussian(self.model, self.glm_layers, blocks, slice_inputs(x, start, start + step), prior_precision)
            chunk, chunk_samples = glm.log_predictive(gaussian, self.link, num_samples, generator)
            log_probs.append(chunk)
            sample_log_probs.append(chunk_samples)
            start += step
            row_bytes = subset_glm.bytes_per_row(self.glm_layers, gaussian.mean.shape[-1], num_samples if self.link == "mc" else 0)
            step = max(1, int(settings.memory_budget(self.max_memory) // row_bytes))
        return _joined(log_probs, sample_log_probs)

    def _weight_space_predictive(self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        """``pred="nn"``: run the network with ``S`` weight draws of the covered layers (others fixed)."""
        params = dict(self.model.named_parameters())
        blocks = self._blocks()
        draws = {b.name: sample_weights(params[b.name].detach(), b, prior_precision, num_samples, generator) for b in blocks}
        sample_log_probs = torch.stack([
            class_log_probs(run_model_with(self.model, {name: draw[s] for name, draw in draws.items()}, x))
            for s in range(num_samples)
        ])
        return torch.logsumexp(sample_log_probs, 0) - math.log(num_samples), sample_log_probs

    def _log_predictive_features(self, phi: Tensor, logits: Tensor, prior_precision: float, generator: torch.Generator | None, num_samples: int | None = None) -> LogPredictive:
        samples = num_samples or self.num_samples
        dtype = torch.promote_types(phi.dtype, torch.float32)
        phi_aug = augment(phi.to(dtype), self._has_bias)
        classes, width = logits.shape[1], phi_aug.shape[1]
        row_bytes = _row_bytes(self.hessian, self.link, classes, width, samples, dtype)
        log_probs, sample_log_probs = [], []
        for rows in glm.row_chunks(phi.shape[0], row_bytes, settings.memory_budget(self.max_memory) / 4):
            gaussian = self.logit_gaussian(phi_aug[rows], logits[rows], prior_precision)
            chunk, chunk_samples = glm.log_predictive(gaussian, self.link, samples, generator)
            log_probs.append(chunk)
            sample_log_probs.append(chunk_samples)
        return _joined(log_probs, sample_log_probs)

    def logit_gaussian(self, phi_aug: Tensor, logits: Tensor, prior_precision: float | None = None) -> glm.LogitGaussian:
        """The Gaussian over logits for head inputs ``phĩ = [phi, 1]`` (see :mod:`posthoc.methods.laplace.glm_predictive`)."""
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        if self.hessian == "kron":
            return glm.kron_logits(phi_aug, logits, self.out_eigvals, self.out_eigvecs, self.in_eigvals, self.in_eigvecs, delta)
        if self.hessian == "diag":
            return glm.diag_logits(phi_aug, logits, self.diagonal, delta)
        return glm.full_logits(phi_aug, logits, self.eigvals, self.eigvecs, delta)

    # ---------------------------------------------------------------------------- helpers
    def spectrum(self) -> Tensor:
        """Eigenvalues of the fitted (approximate) GGN, flattened."""
        if self.subset != "last_layer":
            return torch.cat([block.spectrum() for block in self._blocks()])
        return ggn_spectrum(
            self.hessian,
            getattr(self, "out_eigvals", None),
            getattr(self, "in_eigvals", None),
            getattr(self, "eigvals", None),
            getattr(self, "diagonal", None),
        )

    def log_marginal_likelihood(self, prior_precision: float | None = None) -> float:
        """The Laplace log evidence of the fitted posterior at ``prior_precision`` (default: the fitted one)."""
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        return float(log_marginal_likelihood(self.spectrum(), self.train_loss, self.square_norm, delta))

    @property
    def _has_bias(self) -> bool:
        return self.split.head.bias is not None

    def _check_head_memory(self) -> None:
        head = self.split.head
        check_memory(self.hessian, head.in_features, head.out_features, head.bias is not None,
                     settings.memory_budget(self.max_memory))

    def extra_repr(self) -> str:
        return f"hessian={self.hessian!r}, link={self.link!r}, prior_precision={float(self.prior_precision):.4g}"


def _joined(log_probs: list[Tensor], sample_log_probs: list[Tensor | None]) -> LogPredictive:
    """One predictive from per-chunk ones: rows along dim 0, samples ``(S, n, C)`` along dim 1."""
    if sample_log_probs[0] is None:
        return torch.cat(log_probs), None
    return torch.cat(log_probs), torch.cat(sample_log_probs, dim=1)


def run_model_with(model: nn.Module, replaced: dict[str, Tensor], x: Inputs) -> Tensor:
    """The model's output with some parameters replaced, without touching the model (``functional_call``)."""
    return run_model(lambda *args, **kwargs: torch.func.functional_call(model, replaced, args, kwargs), x)


def _labels(y: Tensor | None, logits: Tensor | tuple[int, int]) -> Tensor:
    """Validated class labels for ``logits`` (or its ``(rows, classes)`` shape)."""
    rows, classes = logits if isinstance(logits, tuple) else logits.shape
    if y is not None and isinstance(y, Tensor) and y.dim() > 1 and y.shape[1] > 1:
        raise InputError(
            f"labels have shape {tuple(y.shape)}: this looks like regression or one-hot targets, but "
            "the Laplace fit here is for classifiers; pass integer class indices of shape (N,)"
        )
    labels = check_labels(y, classes)
    if labels.numel() != rows:
        raise InputError(f"got {labels.numel()} labels for {rows} inputs; pass one class index per input")
    return labels


def _row_bytes(hessian: str, link: str, classes: int, width: int, samples: int, dtype: torch.dtype) -> int:
    per_row = 4 * classes + (width if hessian == "kron" else 0)
    if hessian == "full":
        per_row += 2 * classes * classes + classes * num_params(width, classes, False)
    if link == "mc":
        per_row += 3 * samples * classes
    return per_row * max(torch.finfo(dtype).bits // 8, 8)


def _check_options(hessian: str, subset: str | list[str], prior_precision: str | float, link: str, pred: str, num_samples: int, max_memory: int | None) -> None:
    if hessian not in (*STRUCTURES, "kron-mc"):
        raise ConfigError(f"hessian must be one of {(*STRUCTURES, 'kron-mc')}, got {hessian!r}")
    if subset == "last_layer" and hessian == "kron-mc":
        raise ConfigError("hessian='kron-mc' samples BackPACK's KFAC for deeper subsets; the last-layer GGN is exact and as cheap: use 'kron'")
    if subset != "last_layer" and hessian not in SUBSET_STRUCTURES:
        raise ConfigError(
            f"hessian={hessian!r} over several layers is not offered (a dense GGN of many layers does not "
            f"fit in memory); use one of {tuple(SUBSET_STRUCTURES)}"
        )
    if not (subset in ("last_layer", "all") or (isinstance(subset, (list, tuple)) and subset and all(isinstance(s, str) for s in subset))):
        raise ConfigError(f"subset must be 'last_layer', 'all' or a non-empty list of module names, got {subset!r}")
    if isinstance(prior_precision, str):
        if prior_precision not in PRIOR_MODES:
            raise ConfigError(f"prior_precision must be a positive float or one of {PRIOR_MODES}, got {prior_precision!r}")
    elif isinstance(prior_precision, bool) or not isinstance(prior_precision, (int, float)) or not math.isfinite(prior_precision) or prior_precision <= 0:
        raise ConfigError(
            f"prior_precision must be a positive finite float (a Gaussian prior's precision, like "
            f"weight decay) or one of {PRIOR_MODES}, got {prior_precision!r}"
        )
    if link not in glm.LINKS:
        raise ConfigError(f"link must be one of {glm.LINKS}, got {link!r}")
    if pred not in ("glm", "nn"):
        raise ConfigError(f"pred must be 'glm' or 'nn', got {pred!r}")
    if pred == "nn" and subset == "last_layer":
        raise ConfigError(
            "pred='nn' samples weights through the network, which for the last layer is the same "
            "distribution as the exact logit-space predictive: use pred='glm' with link='mc'"
        )
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ConfigError(f"num_samples must be a positive integer, got {num_samples!r}")
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1):
        raise ConfigError(f"max_memory must be a positive number of bytes (or None), got {max_memory!r}")
