"""Small helpers over a model's module tree: names, owners, eval mode, compiled wrappers.

Example:
    >>> from torch import nn
    >>> from posthoc.core.modules import module_name
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.1))
    >>> module_name(net, net[0])
    '0'
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from posthoc.errors import HeadNotFoundError


def uncompiled(model: nn.Module) -> nn.Module:
    """The original module of a ``torch.compile``-d model (same parameters), else ``model`` itself: posthoc's
    temporary hooks on submodules would recompile a compiled graph every time.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.core.modules import uncompiled
        >>> net = nn.Linear(2, 2)
        >>> uncompiled(torch.compile(net)) is net
        True
    """
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def parameter_owners(model: nn.Module, param_names: Iterable[str]) -> dict[str, nn.Module]:
    """The modules that own ``param_names`` (``"classifier.1.weight"`` -> ``"classifier.1"``), in order, once each."""
    names = dict.fromkeys(name.rpartition(".")[0] for name in param_names)
    return {name: model.get_submodule(name) for name in names}


def module_name(model: nn.Module, module: nn.Module) -> str | None:
    """The qualified name of ``module`` inside ``model`` (``""`` for the root), or ``None``."""
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return None


def qualified(module_name: str, name: str) -> str:
    """The full name of ``name`` (a parameter, a child) of the module called ``module_name`` (``""``: the root)."""
    return f"{module_name}.{name}" if module_name else name


def get_submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.get_submodule(name)`` with an error that lists the available names."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        shown = ", ".join(names[:30]) + (" ..." if len(names) > 30 else "")
        raise HeadNotFoundError(f"the model has no module named '{name}'; available: {shown}") from None


@contextmanager
def eval_mode(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[nn.Module]:
    """Put every submodule in eval mode, restoring each one's own flag afterwards; ``modules`` (``model.modules()``
    listed once by the caller) saves walking the tree.

    Example:
        >>> from torch import nn
        >>> from posthoc.core.modules import eval_mode
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        >>> with eval_mode(net):
        ...     net[1].training
        False
        >>> net[1].training
        True
    """
    flags = [(m, m.training) for m in (model.modules() if modules is None else modules)]
    training = [m for m, flag in flags if flag]
    if all(type(m).train is nn.Module.train for m in training):  # what eval() does, without walking the tree again
        for module in training:
            module.training = False
    else:
        model.eval()  # a module with its own train() (e.g. one that freezes parts) gets its own call
    try:
        yield model
    finally:
        for module, flag in flags:  # every module's own flag, also one the block switched (a fine-tune's train())
            if module.training != flag:
                module.training = flag


@contextmanager
def requires_grad(model: nn.Module, flag: bool) -> Iterator[nn.Module]:
    """Set every parameter's ``requires_grad`` to ``flag``, restoring each one's own flag afterwards.

    Example:
        >>> from posthoc.core.modules import requires_grad
        >>> from torch import nn
        >>> net = nn.Linear(2, 2)
        >>> with requires_grad(net, False):
        ...     net.weight.requires_grad
        False
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(flag)
        yield model
    finally:
        for p, was in flags:
            p.requires_grad_(was)
