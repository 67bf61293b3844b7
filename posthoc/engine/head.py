"""Finding a classifier's head and splitting the model into features and head.

The head is found in this order: a user-named module; timm's ``get_classifier()``; a Hugging Face classifier's head
(a Linear with ``config.num_labels`` outputs, also inside ``peft``); the known torchvision heads; the last
``nn.Linear`` reached in a traced forward pass. :class:`FeatureSplit` captures the head's input with a temporary hook,
so the features ``phi`` and the logits come from one ordinary forward pass.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.head import FeatureSplit
    >>> net = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> split = FeatureSplit(net)
    >>> phi, logits = split(torch.randn(2, 4))
    >>> phi.shape, split.head_name
    (torch.Size([2, 8]), '3')
"""

from __future__ import annotations

from torch import Tensor, nn

from posthoc.core.inputs import Inputs, run_model
from posthoc.core.modules import eval_mode, get_submodule, module_name
from posthoc.engine.feature_store import head_features
from posthoc.engine.hooks import called_in_order, hooked
from posthoc.errors import HeadNotFoundError

TORCHVISION_HEADS = ("fc", "classifier", "heads.head", "head")
#: Hugging Face classification heads: BERT/ViT ``classifier``, RoBERTa-style ``classifier.out_proj``
#: (after ``classifier.dense``), decoder models' ``score``
HF_HEADS = ("classifier", "classifier.out_proj", "score")


def _last_linear(module: nn.Module) -> nn.Module | None:
    if isinstance(module, nn.Linear):
        return module
    if isinstance(module, nn.Sequential):
        for child in reversed(module):
            found = _last_linear(child)
            if found is not None:
                return found
    return None


#: modules that keep the width of their input (the last Linear's outputs pass through them unchanged in number)
WIDTH_KEEPING = (
    nn.Identity,
    nn.Dropout,
    nn.ReLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardtanh,
)


def output_width(model: nn.Module) -> int | None:
    """The number of outputs per example of a ``nn.Linear``, or a ``nn.Sequential`` ending in one (then only
    width-keeping layers); ``None`` otherwise.

    Example:
        >>> from torch import nn
        >>> from posthoc.engine.head import output_width
        >>> output_width(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Dropout(0.1)))
        3
    """
    if isinstance(model, nn.Linear):
        return model.out_features
    if isinstance(model, nn.Sequential):
        for child in reversed(model):
            if isinstance(child, (nn.Linear, nn.Sequential)):
                return output_width(child)
            if not isinstance(child, WIDTH_KEEPING):
                return None
    return None


def _timm_head(model: nn.Module) -> nn.Module | None:
    get_classifier = getattr(model, "get_classifier", None)
    if not callable(get_classifier):
        return None
    head = get_classifier()
    if isinstance(head, nn.Module) and not isinstance(head, nn.Identity) and module_name(model, head) is not None:
        return _last_linear(head) or head
    return None


def _torchvision_head(model: nn.Module) -> nn.Module | None:
    for name in TORCHVISION_HEADS:
        try:
            candidate = model.get_submodule(name)
        except AttributeError:
            continue
        found = _last_linear(candidate)
        if found is not None:
            return found
    return None


def _running_copy(module: nn.Module) -> nn.Module:
    """The copy that runs: a ``peft`` ``ModulesToSaveWrapper``'s active trained head, else ``module``."""
    copies, active = getattr(module, "modules_to_save", None), getattr(module, "active_adapter", None)
    active = active[0] if isinstance(active, (list, tuple)) and active else active
    if isinstance(copies, nn.ModuleDict) and isinstance(active, str) and active in copies:
        return copies[active]
    return module


def _hf_head(model: nn.Module) -> nn.Module | None:
    """A Hugging Face classifier's head: a Linear with ``config.num_labels`` outputs among :data:`HF_HEADS` or the
    model's ``get_output_embeddings()``."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    labels = getattr(getattr(base, "config", None), "num_labels", None)
    if not isinstance(labels, int):
        return None
    candidates = []
    for name in HF_HEADS:
        try:
            candidates.append(_running_copy(base.get_submodule(name)))
        except AttributeError:
            continue
    output_embeddings = getattr(base, "get_output_embeddings", None)
    if callable(output_embeddings):
        candidates.append(output_embeddings())
    return next((m for m in candidates if isinstance(m, nn.Linear) and m.out_features == labels), None)


def _traced_last_linear(model: nn.Module, example: Inputs) -> nn.Module | None:
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    with eval_mode(model):
        order = called_in_order(model, linears, example, at="output")
    return linears[order[-1]] if order else None


def find_head(
    model: nn.Module, head: str | nn.Module | None = None, example: Inputs | None = None
) -> tuple[str, nn.Module]:
    """Locate the classifier head and return ``(name, module)``; ``head`` (a name or the module) skips the search,
    ``example`` (an input batch) allows the traced fallback.

    Example:
        >>> import torchvision
        >>> from posthoc.engine.head import find_head
        >>> find_head(torchvision.models.resnet18(num_classes=3))[0]
        'fc'
    """
    if isinstance(head, str):
        module = get_submodule(model, head)
    elif isinstance(head, nn.Module):
        module = head
    elif head is not None:
        raise HeadNotFoundError(f"head must be a module name or an nn.Module, got {type(head).__name__}")
    else:
        module = _timm_head(model) or _hf_head(model) or _torchvision_head(model)
        if module is None and isinstance(model, nn.Sequential):
            module = _last_linear(model)
        if module is None and example is not None:
            module = _traced_last_linear(model, example)
    if module is None:
        hint = "" if example is not None else " (no input was seen yet to trace the forward pass)"
        raise HeadNotFoundError(
            f"could not find the classifier head of {type(model).__name__}{hint}; pass the head's "
            "name, e.g. posthoc.wrap(model, method=..., head='classifier.3')"
        )
    name = module_name(model, module)
    if name is None:
        raise HeadNotFoundError("the given head module is not part of the model")
    return name, module


class FeatureSplit:
    """Split a classifier at its head: ``phi, logits = split(x)`` in one forward pass.

    The head must be an ``nn.Linear`` whose output is the model's output (checked on every call).

    Example:
        >>> import torchvision
        >>> from posthoc.engine.head import FeatureSplit
        >>> split = FeatureSplit(torchvision.models.resnet18(num_classes=3))
        >>> split.head.in_features
        512
    """

    def __init__(self, model: nn.Module, head: str | nn.Module | None = None) -> None:
        self.model = model
        self._head_spec = head
        self.head_name: str | None = None
        self.head: nn.Linear | None = None
        if (
            head is not None
            or _timm_head(model) is not None
            or _hf_head(model) is not None
            or _torchvision_head(model) is not None
            or isinstance(model, nn.Sequential)
        ):
            self._resolve(None)

    def _resolve(self, example: Inputs | None) -> None:
        name, module = find_head(self.model, self._head_spec, example)
        if not isinstance(module, nn.Linear):
            raise HeadNotFoundError(
                f"the head '{name}' is a {type(module).__name__}, not nn.Linear; last-layer methods "
                "need a linear head. Name a Linear module with head=..., or use a method that does "
                "not split the model (e.g. 'mc-dropout' with where='blocks')"
            )
        self.head_name, self.head = name, module

    def __call__(self, x: Inputs) -> tuple[Tensor, Tensor]:
        """Return ``(phi, logits)``: the head's input ``(N, D)`` and the model's output ``(N, C)`` (a model that squeezes
        its head's one output to ``(N,)`` gives the head's ``(N, 1)``)."""
        if self.head is None:
            self._resolve(x)
        stored = head_features(self.model, self.head, x)
        if stored is not None:  # computed once in this fit (posthoc.engine.feature_store)
            return stored
        captured: dict[str, Tensor] = {}

        def capture(module: nn.Module, args: tuple, out: Tensor) -> None:
            captured["phi"], captured["out"] = args[0], out

        with hooked([(self.head, "output", capture)]):
            logits = run_model(self.model, x)
        if "phi" not in captured:
            raise HeadNotFoundError(
                f"the head '{self.head_name}' was not called in the forward pass; name the head explicitly"
            )
        out = captured["out"]
        if out is not logits and not _one_output_squeezed(out, logits):
            raise HeadNotFoundError(
                f"the output of '{self.head_name}' is not the model's output (the model transforms "
                "it afterwards); name the module whose output is the logits with head=..."
            )
        phi = captured["phi"]
        if phi.dim() != 2:
            raise HeadNotFoundError(
                f"the head '{self.head_name}' receives inputs of shape {tuple(phi.shape)}; last-layer "
                "methods need (N, D) features"
            )
        return phi, out


def _one_output_squeezed(out: Tensor, logits: Tensor) -> bool:
    """Whether ``logits`` ``(N,)`` is the head's one output ``(N, 1)`` squeezed (the same storage)."""
    return (
        out.dim() == 2
        and out.shape[1] == 1
        and tuple(logits.shape) == (out.shape[0],)
        and logits.data_ptr() == out.data_ptr()
    )
