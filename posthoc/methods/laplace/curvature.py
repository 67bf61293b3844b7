"""Fitting the curvature: the last layer in closed form (any likelihood), deeper layers with BackPACK (softmax or Gaussian).

For a linear head ``logits = W phi + b`` the GGN of example ``n`` is ``H_n ⊗ phĩ_n phĩ_nᵀ``, with ``H_n`` the
likelihood's loss Hessian in the outputs and ``phĩ = [phi, 1]``: :class:`LastLayerGGN` sums it from one forward pass,
with no backward pass through the backbone. Parameters are ordered class-major over ``phĩ`` (``d = D`` is the bias).
Deeper layers: :func:`backpack_ggn`, BackPACK's ``KFLR``, ``KFAC`` or ``DiagGGNExact`` on a private copy of the model.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.curvature import LastLayerGGN
    >>> from posthoc_apps.demo.examples import train_loader, model
    >>> ggn = LastLayerGGN("kron", num_features=64, num_classes=3, bias=True)
    >>> with torch.no_grad():
    ...     for inputs, targets in train_loader:          # one forward pass per training batch
    ...         phi = model[:3](inputs)                   # the head's input (64, 64)
    ...         ggn.update(phi, model[3](phi), targets)
    >>> block = ggn.finalize()
    >>> block.out_eigvals.shape, block.in_eigvals.shape
    (torch.Size([3]), torch.Size([65]))
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable

import backpack
import torch
from backpack import extensions
from torch import Tensor, nn

from posthoc.core.chunks import chunks
from posthoc.core.likelihood import Categorical, Likelihood, model_outputs
from posthoc.engine.runner import sum_over_ranks
from posthoc.errors import ConfigError, NumericalError
from posthoc.methods.laplace.structure import FLOAT64, Curvature
from posthoc.methods.laplace.structures import structure_class

#: float64 values per output that one row of :meth:`LastLayerGGN.update` keeps alive (probabilities, log-probabilities,
#: the Hessian's diagonal and its temporaries, with room for the batch's own logits)
UPDATE_ROW_VALUES = 6


def augment(phi: Tensor, bias: bool) -> Tensor:
    """``[phi, 1]`` when the head has a bias, else ``phi`` (the inputs the head's weights see)."""
    if not bias:
        return phi
    return torch.cat([phi, phi.new_ones(phi.shape[0], 1)], dim=1)


class LastLayerGGN:
    """Accumulate the last-layer GGN of a ``structure`` batch by batch, with the loss Hessian of ``likelihood`` (default:
    the softmax's); ``loss`` sums the NLL at the checkpoint at unit dispersion, ``num_data`` counts the examples."""

    def __init__(
        self,
        structure: str,
        num_features: int,
        num_classes: int,
        bias: bool,
        device: torch.device | str = "cpu",
        likelihood: Likelihood | None = None,
    ) -> None:
        self.kind = structure_class(structure)
        self.likelihood = Categorical() if likelihood is None else likelihood
        self.bias = bias
        self.statistics = self.kind.head_statistics(num_classes, num_features + int(bias), device)
        self.loss, self.num_data = torch.zeros((), dtype=FLOAT64, device=device), 0

    @torch.no_grad()
    def update(self, phi: Tensor, logits: Tensor, labels: Tensor) -> None:
        """Add one batch: head inputs ``phi (N, D)``, outputs ``(N, C)``, targets (labels ``(N,)``, or regression targets)."""
        dtype = torch.promote_types(phi.dtype, torch.float32)
        self.num_data += phi.shape[0]
        # the float64 probabilities, loss terms and Hessian diagonal of a wide head: row chunks under the budget
        for rows in chunks(phi.shape[0], UPDATE_ROW_VALUES * logits.shape[-1] * 8):
            part = logits[rows]
            self.loss += self.likelihood.unit_loss(part, labels[rows])
            self.kind.accumulate(
                self.statistics, augment(phi[rows].to(dtype), self.bias), self.likelihood.loss_hessian(part)
            )

    def finalize(self) -> Curvature:
        """Sum over ranks and return the fitted block (eigen-decomposed where its structure needs it)."""
        self.statistics, self.loss, self.num_data = sum_over_ranks((self.statistics, self.loss, self.num_data))
        if self.num_data == 0:
            raise NumericalError("no training examples were seen; the curvature is undefined")
        return self.kind.from_head_statistics(self.statistics, self.num_data, self.bias)


#: module types whose weights BackPACK's KFAC / diagonal GGN support
BACKPACK_LAYERS = (nn.Linear, nn.Conv2d)
#: module types that cannot sit between the loss and a curvature layer (BackPACK has no KFAC rule for them)
BACKPACK_UNSUPPORTED = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.MultiheadAttention,
)
SUBSET_STRUCTURES = {"kron": "KFLR", "kron-mc": "KFAC", "diag": "DiagGGNExact"}
#: module names under which peft keeps LoRA adapters' Linear layers
LORA_MODULES = ("lora_A", "lora_B")


def subset_parameters(model: nn.Module, subset: str | list[str]) -> list[str]:
    """Qualified names of the parameters a deeper Laplace covers (``"all"``: every Linear/Conv2d).

    Example:
        >>> from torch import nn
        >>> from posthoc.methods.laplace.curvature import subset_parameters
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
        >>> from posthoc.methods.laplace.curvature import lora_parameters
        >>> from posthoc_apps.demo.examples import model
        >>> from peft import LoraConfig, get_peft_model
        >>> lora_parameters(get_peft_model(model, LoraConfig(r=4, target_modules=["0"])))   # LoRA on the first Linear
        ['base_model.model.0.lora_A.default.weight', 'base_model.model.0.lora_B.default.weight']
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


def backpack_ggn(
    model: nn.Module,
    param_names: list[str],
    structure: str,
    batches: Iterable[tuple[Tensor, Tensor]],
    likelihood: Likelihood | None = None,
) -> tuple[list[Curvature], Tensor]:
    """The KFAC or diagonal GGN blocks of ``param_names`` from BackPACK on a private copy of ``model`` (``G = Σ_n G_n``,
    ``A = Σ_n a aᵀ / N``), and the summed NLL at the checkpoint at unit dispersion. BackPACK's squared error has the
    loss Hessian ``2 I``: its GGN is halved to the unit-noise one, which the caller divides by ``σ²``."""
    likelihood = Categorical() if likelihood is None else likelihood
    extension = getattr(extensions, SUBSET_STRUCTURES[structure])()
    attribute = {"kron": "kflr", "kron-mc": "kfac", "diag": "diag_ggn_exact"}[structure]
    copy_ = copy.deepcopy(model).eval()
    for module in copy_.modules():  # hook the leaves only: containers (e.g. a custom nn.Module) have no rule
        if not list(module.children()):
            backpack.extend(module)
    squared_error = likelihood.fits_noise
    loss_fn = backpack.extend(nn.MSELoss(reduction="sum") if squared_error else nn.CrossEntropyLoss(reduction="sum"))
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
            outputs = model_outputs(copy_(x)) if squared_error else copy_(x)  # a regressor's (N,) as (N, 1)
            batch_loss = loss_fn(outputs, y.to(outputs.dtype) if squared_error else y)
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
            loss += likelihood.unit_loss(outputs.detach(), y) if squared_error else batch_loss.detach().to(FLOAT64)
            count += y.shape[0]
            for name in param_names:
                found = getattr(params[name], attribute)
                found = [found] if isinstance(found, Tensor) else list(found)
                if len(found) == 2:
                    found[1] = found[1] * y.shape[0]  # A is a batch mean: re-weight to combine batches
                if squared_error:
                    found[0] = found[0] / 2  # BackPACK's squared error has the loss Hessian 2 I
                found = [f.detach().to(FLOAT64) for f in found]
                sums[name] = found if name not in sums else [s + f for s, f in zip(sums[name], found)]
    loss, count, sums = sum_over_ranks((loss, count, sums))  # every rank holds the sums over all shards
    return [structure_class(structure).from_sums(sums[name], count, name) for name in param_names], loss
