"""Curvature of the categorical likelihood: last-layer closed forms and BackPACK-backed KFAC.

For a linear head ``logits = W phi + b`` and a softmax likelihood, the generalised Gauss-Newton
(GGN, equal to the Fisher here) of example ``n`` is ``H_n ⊗ phĩ_n phĩ_nᵀ`` with
``H_n = diag(p_n) - p_n p_nᵀ`` and ``phĩ = [phi, 1]`` (the 1 carries the bias). So the whole
last-layer GGN follows in closed form from the features and probabilities of ONE forward pass,
with no backward pass through the backbone:

- ``"full"``: ``Σ_n H_n ⊗ phĩ_n phĩ_nᵀ``, a ``C(D+1) x C(D+1)`` matrix (exact);
- ``"diag"``: its diagonal, ``Σ_n p_nc (1 - p_nc) phĩ_nd²`` (exact);
- ``"kron"``: ``G ⊗ A`` with ``G = Σ_n H_n`` and ``A = Σ_n phi_n phi_nᵀ / N`` for the weight and
  ``G`` alone for the bias (two Kronecker blocks sharing ``G``, the KFAC layout of BackPACK and
  laplace-torch). Equivalently ``G ⊗ blockdiag(A, 1)`` over ``phĩ``.

Parameters are ordered class-major over ``phĩ``: index ``c * (D + 1) + d`` (``d = D`` is the bias).

LoRA adapters (``subset="lora"``, :func:`lora_parameters`) get theirs from hooks instead
(:mod:`posthoc.methods.laplace.hooked_kfac`). More layers (:func:`backpack_ggn`): BackPACK's ``KFLR`` (exact KFAC), ``KFAC`` (MC-sampled) or
``DiagGGNExact`` on a private copy of the model, for Linear/Conv2d layers; every module between
the loss and those layers must be one BackPACK supports (no BatchNorm/LayerNorm/attention).

Example:
    >>> ggn = LastLayerGGN("kron", num_features=64, num_classes=8, bias=True)
    >>> ggn.update(phi, logits, labels)  # once per training batch
    >>> curv = ggn.finalize()
    >>> curv.out_eigvals.shape, curv.in_eigvals.shape
    (torch.Size([8]), torch.Size([65]))
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import backpack
import torch
from backpack import extensions
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.errors import ConfigError, NumericalError
from posthoc.core.threads import single_thread_if
from posthoc.engine.random_draws import randn

STRUCTURES = ("kron", "full", "diag")
FLOAT64 = torch.float64


def augment(phi: Tensor, bias: bool) -> Tensor:
    """``[phi, 1]`` when the head has a bias, else ``phi`` (the inputs the head's weights see)."""
    if not bias:
        return phi
    return torch.cat([phi, phi.new_ones(phi.shape[0], 1)], dim=1)


def full_hessian_bytes(num_features: int, num_classes: int, bias: bool = True) -> int:
    """Bytes the ``"full"`` structure holds: the GGN and its eigenvectors, in float64."""
    params = num_classes * (num_features + int(bias))
    return 2 * params * params * 8


def check_memory(structure: str, num_features: int, num_classes: int, bias: bool, budget_bytes: float) -> None:
    """Refuse a structure whose matrices would not fit in ``budget_bytes``, before allocating them."""
    if structure != "full":
        return
    needed = full_hessian_bytes(num_features, num_classes, bias)
    if needed > budget_bytes:
        params = num_classes * (num_features + int(bias))
        raise ConfigError(
            f"hessian='full' on this head needs a {params:,} x {params:,} matrix and its eigenvectors "
            f"({needed / 2**30:.1f} GiB in float64), over the memory budget of {budget_bytes / 2**30:.1f} "
            "GiB. Use hessian='kron' (Kronecker factors, the default) or hessian='diag', or raise "
            "max_memory (bytes) if the machine really has the memory"
        )


def non_finite_curvature(what: str) -> NumericalError:
    """The error for a curvature with NaN or inf in it, saying what to try (the inputs were checked finite)."""
    return NumericalError(
        f"the {what} contains NaN or inf although the inputs are finite: the model's features or logits "
        "overflow, or its weights hold NaN. Check torch.isfinite on model.parameters() and on the model's "
        "output for a training batch; if the model runs in float16/bfloat16, fit in float32 (model.float()); "
        "if the features are huge, normalise the inputs as in training"
    )


def symmetric_eig(matrix: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a PSD matrix; warns on clearly negative curvature."""
    if not torch.isfinite(matrix).all():
        raise non_finite_curvature(what)
    matrix = (matrix + matrix.T) / 2
    # a small CPU eigh runs on one thread: LAPACK's threads wait on each other (see posthoc.core.threads)
    with single_thread_if(matrix.device.type == "cpu" and matrix.shape[0] <= 1024):
        try:
            values, vectors = torch.linalg.eigh(matrix)
        except RuntimeError:  # eigh did not converge: add and remove a jitter
            jitter = 1e-8 * float(matrix.diagonal().abs().max().clamp_min(1.0))
            eye = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
            values, vectors = torch.linalg.eigh(matrix + jitter * eye)
            values = values - jitter
    return clamp_curvature(values, what), vectors


def clamp_curvature(values: Tensor, what: str) -> Tensor:
    """Clamp eigenvalues/diagonal entries of a GGN at 0, warning when they were clearly negative."""
    if not torch.isfinite(values).all():
        raise non_finite_curvature(what)
    scale = float(values.abs().max()) if values.numel() else 0.0
    if values.numel() and float(values.min()) < -1e-4 * max(scale, 1e-30):
        warnings.warn(
            f"the {what} has negative curvature (min {float(values.min()):.3g}); a GGN is positive "
            "semi-definite, so this is round-off from ill-conditioned features: clamped to 0",
            RuntimeWarning,
            stacklevel=3,
        )
    return values.clamp_min(0.0)


@dataclass
class LastLayerCurvature:
    """The last-layer GGN in the form each structure needs (all float64).

    Attributes:
        structure: ``"kron"``, ``"full"`` or ``"diag"``.
        loss: summed cross-entropy of the training data at the checkpoint (``-log p(D | θ)``).
        num_data: number of training examples.
        out_eigvals, out_eigvecs: ``kron`` — eigen-decomposition of ``G`` (C), (C, C).
        in_eigvals, in_eigvecs: ``kron`` — of ``blockdiag(A, 1)`` (D+1), (D+1, D+1).
        eigvals, eigvecs: ``full`` — of the GGN (P), (P, P).
        diagonal: ``diag`` — the GGN diagonal shaped (C, D+1).
    """

    structure: str
    loss: Tensor
    num_data: int
    out_eigvals: Tensor | None = None
    out_eigvecs: Tensor | None = None
    in_eigvals: Tensor | None = None
    in_eigvecs: Tensor | None = None
    eigvals: Tensor | None = None
    eigvecs: Tensor | None = None
    diagonal: Tensor | None = None

    def spectrum(self) -> Tensor:
        """All eigenvalues of the (approximate) GGN, flattened: what the marginal likelihood needs."""
        return ggn_spectrum(self.structure, self.out_eigvals, self.in_eigvals, self.eigvals, self.diagonal)


def ggn_spectrum(structure: str, out_eigvals: Tensor | None, in_eigvals: Tensor | None, eigvals: Tensor | None, diagonal: Tensor | None) -> Tensor:
    """Flattened GGN eigenvalues: ``λ_i μ_j`` for kron, the eigenvalues for full, the entries for diag."""
    if structure == "kron":
        return torch.outer(out_eigvals, in_eigvals).reshape(-1)
    if structure == "full":
        return eigvals
    return diagonal.reshape(-1)


class LastLayerGGN:
    """Accumulate the last-layer GGN of a softmax classifier batch by batch (see module docs).

    Args:
        structure: ``"kron"``, ``"full"`` or ``"diag"``.
        num_features: ``D``, the head's input width.
        num_classes: ``C``.
        bias: whether the head has a bias.
    """

    def __init__(self, structure: str, num_features: int, num_classes: int, bias: bool, device: torch.device | str = "cpu") -> None:
        if structure not in STRUCTURES:
            raise ConfigError(f"hessian must be one of {STRUCTURES}, got {structure!r}")
        self.structure, self.bias = structure, bias
        self.num_classes = num_classes
        width = num_features + int(bias)
        zeros = lambda *shape: torch.zeros(*shape, dtype=FLOAT64, device=device)  # noqa: E731
        self.loss, self.num_data = zeros(()), 0
        if structure == "kron":
            self.out_factor, self.in_factor = zeros(num_classes, num_classes), zeros(width, width)
        elif structure == "full":
            self.matrix = zeros(num_classes * width, num_classes * width)
        else:
            self.diagonal = zeros(num_classes, width)

    @torch.no_grad()
    def update(self, phi: Tensor, logits: Tensor, labels: Tensor) -> None:
        """Add one batch: head inputs ``phi (N, D)``, logits ``(N, C)``, labels ``(N,)``."""
        dtype = torch.promote_types(phi.dtype, torch.float32)
        phi_aug = augment(phi.to(dtype), self.bias)
        logits = logits.to(FLOAT64)
        probs = torch.softmax(logits, dim=-1)
        self.loss += torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        self.num_data += phi.shape[0]
        if self.structure == "kron":
            self.out_factor += torch.diag(probs.sum(0)) - probs.T @ probs
            self.in_factor += (phi_aug.T @ phi_aug).to(FLOAT64)
        elif self.structure == "diag":
            self.diagonal += (probs * (1 - probs)).T @ phi_aug.to(FLOAT64).square()
        else:
            # Σ_n (diag p_n - p_n p_nᵀ) ⊗ phĩ phĩᵀ = Σ_c e_c e_cᵀ ⊗ phĩᵀ diag(p_c) phĩ - ZᵀZ, Z = p ⊙ phĩ
            phi_aug = phi_aug.to(FLOAT64)
            width = phi_aug.shape[1]
            scaled = probs[:, :, None] * phi_aug[:, None, :]  # (N, C, D+1)
            update = -(scaled.reshape(phi.shape[0], -1).T @ scaled.reshape(phi.shape[0], -1))
            blocks = scaled.permute(1, 2, 0) @ phi_aug  # (C, D+1, D+1): phĩᵀ diag(p_c) phĩ
            for c in range(self.num_classes):
                rows = slice(c * width, (c + 1) * width)
                update[rows, rows] += blocks[c]
            self.matrix += update

    def reduce_across_ranks(self) -> None:
        """Sum the statistics over ``torch.distributed`` ranks (a no-op in one process)."""
        names = {"kron": ("out_factor", "in_factor"), "full": ("matrix",), "diag": ("diagonal",)}[self.structure]
        for name in ("loss", *names):
            setattr(self, name, distributed.all_reduce_sum(getattr(self, name)))
        self.num_data = int(distributed.all_reduce_sum(torch.tensor(self.num_data, dtype=FLOAT64)))

    def finalize(self) -> LastLayerCurvature:
        """Sum over ranks, eigen-decompose what each structure needs and return :class:`LastLayerCurvature`."""
        self.reduce_across_ranks()
        if self.num_data == 0:
            raise NumericalError("no training examples were seen; the curvature is undefined")
        curv = LastLayerCurvature(self.structure, self.loss.clone(), self.num_data)
        if self.structure == "kron":
            in_factor = self.in_factor / self.num_data
            if self.bias:  # the bias is its own Kronecker block G ⊗ 1: drop the weight-bias coupling
                in_factor[-1, :-1] = 0
                in_factor[:-1, -1] = 0
            curv.out_eigvals, curv.out_eigvecs = symmetric_eig(self.out_factor, "output factor G of the GGN")
            curv.in_eigvals, curv.in_eigvecs = symmetric_eig(in_factor, "input factor A of the GGN")
        elif self.structure == "full":
            curv.eigvals, curv.eigvecs = symmetric_eig(self.matrix, "last-layer GGN")
        else:
            curv.diagonal = clamp_curvature(self.diagonal.clone(), "GGN diagonal")
        return curv


def full_matrix(curv: LastLayerCurvature) -> Tensor:
    """The (approximate) GGN as a dense ``(P, P)`` matrix in the class-major order (for tests and small heads)."""
    if curv.structure == "kron":
        out = curv.out_eigvecs @ torch.diag(curv.out_eigvals) @ curv.out_eigvecs.T
        inp = curv.in_eigvecs @ torch.diag(curv.in_eigvals) @ curv.in_eigvecs.T
        return torch.kron(out, inp)
    if curv.structure == "full":
        return curv.eigvecs @ torch.diag(curv.eigvals) @ curv.eigvecs.T
    return torch.diag(curv.diagonal.reshape(-1))


def num_params(num_features: int, num_classes: int, bias: bool) -> int:
    """Number of last-layer parameters ``C (D + bias)``."""
    return num_classes * (num_features + int(bias))


# ------------------------------------------------------------------ BackPACK: more than the last layer
#: module types whose weights BackPACK's KFAC / diagonal GGN support
BACKPACK_LAYERS = (nn.Linear, nn.Conv2d)
#: module types that cannot sit between the loss and a curvature layer (BackPACK has no KFAC rule for them)
BACKPACK_UNSUPPORTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.MultiheadAttention)
SUBSET_STRUCTURES = {"kron": "KFLR", "kron-mc": "KFAC", "diag": "DiagGGNExact"}
#: module names under which peft keeps LoRA adapters' Linear layers
LORA_MODULES = ("lora_A", "lora_B")


@dataclass
class ParamCurvature:
    """The GGN block of one parameter: Kronecker eigen-factors (``in_*`` is ``None`` for a bias) or a diagonal."""

    name: str
    out_eigvals: Tensor | None = None
    out_eigvecs: Tensor | None = None
    in_eigvals: Tensor | None = None
    in_eigvecs: Tensor | None = None
    diagonal: Tensor | None = None

    def spectrum(self) -> Tensor:
        if self.diagonal is not None:
            return self.diagonal.reshape(-1)
        if self.in_eigvals is None:
            return self.out_eigvals
        return torch.outer(self.out_eigvals, self.in_eigvals).reshape(-1)


def subset_parameters(model: nn.Module, subset: str | list[str]) -> list[str]:
    """Qualified names of the parameters a deeper Laplace covers (``"all"``: every Linear/Conv2d).

    Example:
        >>> subset_parameters(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)), "all")
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    if subset == "lora":
        return lora_parameters(model)
    if subset == "all":
        blocking = sorted({type(m).__name__ for m in model.modules() if isinstance(m, BACKPACK_UNSUPPORTED)})
        if blocking:
            layers = [n for n, m in model.named_modules() if isinstance(m, BACKPACK_LAYERS)]
            raise ConfigError(
                f"subset='all' needs BackPACK's KFAC through every layer, but the model has "
                f"{', '.join(blocking)}, which BackPACK does not support. Name the layers after the "
                f"last of them, e.g. subset={layers[-2:]!r}, or use subset='last_layer'"
            )
        modules = [(n, m) for n, m in model.named_modules() if isinstance(m, BACKPACK_LAYERS)]
    else:
        modules = []
        for name in subset:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ConfigError(f"subset names a module '{name}' the model does not have") from None
            if not isinstance(module, BACKPACK_LAYERS):
                raise ConfigError(
                    f"subset module '{name}' is a {type(module).__name__}; KFAC curvature covers "
                    f"{[c.__name__ for c in BACKPACK_LAYERS]} layers only"
                )
            modules.append((name, module))
    if not modules:
        raise ConfigError("subset selects no Linear/Conv2d layer")
    return [f"{n}.{p}" for n, m in modules for p, value in m.named_parameters(recurse=False) if value is not None]


def lora_parameters(model: nn.Module) -> list[str]:
    """The LoRA adapter weights of a ``peft`` model: its ``lora_A`` / ``lora_B`` Linear weights of the active adapters.

    Example:
        >>> lora_parameters(get_peft_model(model, LoraConfig(r=4, target_modules=["query"])))[:1]
        ['base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default.weight']
    """
    found = []
    for name, module in model.named_modules():
        kind, adapter = (["", ""] + name.split("."))[-2:]  # "<layer>.lora_A.<adapter>"
        if not isinstance(module, nn.Linear) or kind not in LORA_MODULES:
            continue
        active = getattr(model.get_submodule(name.rsplit(".", 2)[0]), "active_adapters", None)
        if active is None or adapter in active:
            found += [f"{name}.{p}" for p, value in module.named_parameters(recurse=False) if value is not None]
    if not found:
        raise ConfigError(
            "subset='lora' found no active LoRA adapter (lora_A / lora_B Linear layers) in the model; pass a "
            "peft model (peft.get_peft_model(model, LoraConfig(...)) after fine-tuning), or use subset='last_layer'"
        )
    return found


def backpack_ggn(model: nn.Module, param_names: list[str], structure: str, batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[list[ParamCurvature], Tensor]:
    """KFAC (``KFLR`` exact / ``KFAC`` MC-sampled) or diagonal GGN of ``param_names`` from BackPACK.

    Works on a private deep copy of ``model`` (BackPACK attaches hooks), so the user's model is
    untouched. Factors follow BackPACK's summed-loss convention: ``G = Σ_n G_n``, ``A = Σ_n a aᵀ / N``.
    Returns the eigen-decomposed blocks and the summed cross-entropy at the checkpoint.
    """
    extension = getattr(extensions, SUBSET_STRUCTURES[structure])()
    attribute = {"kron": "kflr", "kron-mc": "kfac", "diag": "diag_ggn_exact"}[structure]
    copy_ = copy.deepcopy(model).eval()
    for module in copy_.modules():  # hook the leaves only: containers (e.g. a custom nn.Module) have no rule
        if not list(module.children()):
            backpack.extend(module)
    loss_fn = backpack.extend(nn.CrossEntropyLoss(reduction="sum"))
    params = dict(copy_.named_parameters())
    for name, value in params.items():
        value.requires_grad_(name in param_names)
    sums: dict[str, list[Tensor]] = {}
    device = params[param_names[0]].device
    loss, count = torch.zeros((), dtype=FLOAT64, device=device), 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # KFAC's MC-sampled targets are reproducible; the caller's generators are restored
        for x, y in batches:
            copy_.zero_grad()
            batch_loss = loss_fn(copy_(x), y)
            try:
                with backpack.backpack(extension), warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    batch_loss.backward()
            except (NotImplementedError, RuntimeError, AttributeError, KeyError) as err:
                raise ConfigError(
                    f"BackPACK could not compute {SUBSET_STRUCTURES[structure]} through this model ({err}); "
                    "a module between the loss and the chosen layers is not supported. Pick layers "
                    "after any BatchNorm/attention block with subset=[...], or use subset='last_layer'"
                ) from err
            loss += batch_loss.detach().to(FLOAT64)
            count += y.shape[0]
            for name in param_names:
                found = getattr(params[name], attribute)
                found = [found] if isinstance(found, Tensor) else list(found)
                if len(found) == 2:
                    found[1] = found[1] * y.shape[0]  # A is a batch mean: re-weight to combine batches
                found = [f.detach().to(FLOAT64) for f in found]
                sums[name] = found if name not in sums else [s + f for s, f in zip(sums[name], found)]
    loss = distributed.all_reduce_sum(loss)  # every rank holds the sums over all shards
    count = int(distributed.all_reduce_sum(torch.tensor(count, dtype=FLOAT64)))
    sums = {name: [distributed.all_reduce_sum(s) for s in found] for name, found in sums.items()}
    blocks = []
    for name in param_names:
        factors = sums[name]
        if structure == "diag":
            blocks.append(ParamCurvature(name, diagonal=clamp_curvature(factors[0], f"GGN diagonal of {name}")))
            continue
        block = ParamCurvature(name)
        block.out_eigvals, block.out_eigvecs = symmetric_eig(factors[0], f"output factor of {name}")
        if len(factors) == 2:
            block.in_eigvals, block.in_eigvecs = symmetric_eig(factors[1] / count, f"input factor of {name}")
        blocks.append(block)
    return blocks, loss


def sample_weights(value: Tensor, block: ParamCurvature, prior_precision: float, num_samples: int, generator: torch.Generator | None) -> Tensor:
    """``num_samples`` draws ``(S, *value.shape)`` from ``N(value, (GGN block + δ I)⁻¹)``."""
    dtype = torch.promote_types(value.dtype, torch.float32)
    shape = (num_samples, *value.shape)
    noise = randn(shape, generator=generator, device=value.device, dtype=dtype)
    if block.diagonal is not None:
        step = noise * torch.rsqrt(block.diagonal + prior_precision).to(dtype)
    elif block.in_eigvals is None:
        step = (noise * torch.rsqrt(block.out_eigvals + prior_precision).to(dtype)) @ block.out_eigvecs.T.to(dtype)
    else:
        scale = torch.rsqrt(torch.outer(block.out_eigvals, block.in_eigvals) + prior_precision).to(dtype)
        matrix = noise.reshape(num_samples, value.shape[0], -1) * scale
        step = block.out_eigvecs.to(dtype) @ matrix @ block.in_eigvecs.T.to(dtype)
    return (value.to(dtype) + step.reshape(shape)).to(value.dtype)
