"""Where DAC reads features: the head's input and a few intermediate layers, found from the model's structure.

A :class:`Site` is a module's ``output`` (or the head's ``input``). :func:`auto_sites` picks the head's input and the
ends of the last ``count`` *stages* before it. The model's top-level children are its blocks (the head's ancestors
and never-called containers such as a ``ModuleList`` are opened); a block holding a weight matrix starts a new stage,
and the block just before it (before any ``Flatten``, ``Identity`` or ``Dropout``) ends the previous one. While fewer
than ``count`` stage ends are found, the largest block with children is opened. So a torchvision ResNet gives
``layer2``, ``layer3`` and the head's input, and a ViT its last encoder blocks.

Features are pooled to ``(N, D)`` (:func:`pooled`); a module returning a tuple or a Hugging Face output is read through
its first tensor. :class:`Capture` records each site's features from the first forward call that reaches it, so they
come from the inner method's own forward pass (rows of an expanded batch are sample-major, so the first ``N`` rows
are the first sample's).

Example:
    >>> import torch
    >>> from posthoc.methods.dac.layers import auto_sites
    >>> from posthoc_apps.demo import zoo
    >>> sites = auto_sites(zoo.pretrained(), torch.zeros(2, 1, 28, 28))
    >>> [str(site) for site in sites]
    ['features.3', 'features.7', 'classifier.4:input']
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, batch_size, label_rows, run_model, slice_inputs
from posthoc.core.modules import eval_mode, get_submodule
from posthoc.engine.feature_store import Tap, features_of
from posthoc.engine.head import find_head
from posthoc.engine.hooks import hooked
from posthoc.errors import ConfigError, HeadNotFoundError
from posthoc.export.modules import first_tensor

#: parameter-free blocks that only reshape or pass on their input: a stage ends before them
RESHAPES = (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout)
#: how many times :func:`auto_sites` may open a block looking for stage ends
MAX_OPENINGS = 8


@dataclass(frozen=True)
class Site:
    """A module's ``output`` (or ``input``) whose pooled features DAC reads; ``str`` is ``name`` or ``name:input``."""

    name: str
    at: str = "output"

    def __str__(self) -> str:
        return self.name if self.at == "output" else f"{self.name}:{self.at}"

    @classmethod
    def parse(cls, text: str) -> Site:
        name, _, at = text.partition(":")
        return cls(name, at or "output")


def pooled(value: Tensor, rows: int) -> Tensor | None:
    """The first ``rows`` rows of an activation pooled to ``(rows, D)`` float32 (the spatial mean of ``(N, C, H, W)``,
    or ``(N, H, W, C)`` when its middle sizes agree; the token mean of ``(N, T, D)``), ``None`` if not per example."""
    if value.dim() < 2 or value.shape[0] < rows or value.shape[0] % rows or not value.is_floating_point():
        return None
    value = value[:rows].detach()
    if value.dim() == 3:
        value = value.mean(1)
    elif value.dim() == 4 and value.shape[1] == value.shape[2] != value.shape[3]:
        value = value.mean((1, 2))  # channels last (N, H, W, C): Swin, ConvNeXt blocks
    elif value.dim() > 3:
        value = value.flatten(2).mean(2)
    return value.float()


class Capture:
    """Forward hooks recording the pooled features of ``sites`` on the first call that reaches each one.

    Example:
        >>> from posthoc.methods.dac.layers import Capture, auto_sites
        >>> from posthoc_apps.demo.examples import model, x
        >>> sites = auto_sites(model, x)
        >>> capture = Capture(model, sites)
        >>> with capture.recording(rows=8) as features:
        ...     logits = model(x)
        >>> [str(site) for site in sites], [f.shape for f in features]   # one (8, D_l) per site: the head's input
        (['3:input'], [torch.Size([8, 64])])
    """

    def __init__(self, model: nn.Module, sites: list[Site]) -> None:
        self.model = model
        self.sites = sites
        self.modules = [get_submodule(model, site.name) for site in sites]

    @contextmanager
    def recording(self, rows: int) -> Iterator[list[Tensor | None]]:
        """Within the context, hooked calls fill the yielded list (``None`` where a site was not reached yet)."""
        found: list[Tensor | None] = [None] * len(self.sites)

        def record(index: int, site: Site) -> Any:
            def hook(module: nn.Module, args: tuple, *output: Any) -> None:
                if found[index] is None:
                    value = first_tensor(args if site.at == "input" else output[0])
                    found[index] = None if value is None else pooled(value, rows)

            return hook

        with hooked(
            (module, site.at, record(i, site)) for i, (module, site) in enumerate(zip(self.modules, self.sites))
        ):
            yield found

    def taps(self) -> list[Tap]:
        """The sites as the engine's feature store records them (pooled activations)."""
        return [Tap(site.name, site.at, pooled) for site in self.sites]

    def _stored(self, x: Inputs) -> list[Tensor | None] | None:
        """The sites' features of batch ``x`` from the fit's feature store (``None`` where it has none)."""
        taps = self.taps()
        entry = features_of(self.model, x, taps)
        return None if entry is None else [entry.taps.get(tap.key) for tap in taps]

    def features(self, found: list[Tensor | None], x: Inputs) -> list[Tensor]:
        """``found`` completed: sites the inner forward pass did not reach are read from a plain forward pass of ``x``."""
        if any(f is None for f in found):
            with torch.no_grad(), eval_mode(self.model):
                again = self._stored(x)
                if again is None or any(f is None and g is None for f, g in zip(found, again)):
                    with self.recording(label_rows(x)) as again:
                        run_model(self.model, x)
            found = [f if f is not None else g for f, g in zip(found, again)]
        missing = [str(site) for site, f in zip(self.sites, found) if f is None]
        if missing:
            raise ConfigError(
                f"dac reads features at {missing}, but the forward pass gives no per-example floating "
                "tensor there; name other modules with layers=[...]"
            )
        return found  # type: ignore[return-value]


def _weighted(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def _trace(model: nn.Module, x: Inputs) -> dict[str, tuple[int, bool]]:
    """For every module a forward pass of ``x`` calls: ``(order of its first return, whether it gives per-example features)``."""
    rows = batch_size(x)
    seen: dict[str, tuple[int, bool]] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            if name not in seen:
                value = first_tensor(output)
                seen[name] = (len(seen), value is not None and pooled(value, rows) is not None)

        return record

    named = list(model.named_modules())  # the root too: a model may be its own head (a bare nn.Linear)
    with torch.no_grad(), eval_mode(model), hooked((module, "output", hook(name)) for name, module in named):
        run_model(model, x)
    return seen


def _blocks(
    model: nn.Module, prefix: str, head: str, called: dict[str, tuple[int, bool]], opened: set[str]
) -> list[str]:
    """The blocks under ``prefix``: children, with the head's ancestors, uncalled containers and ``opened`` ones opened."""
    out = []
    for name, child in model.named_children():
        full = prefix + name
        if full == head:
            continue
        if (
            head.startswith(full + ".")
            or full in opened
            or (full not in called and any(True for _ in child.children()))
        ):
            out += _blocks(child, full + ".", head, called, opened)
        elif full in called:
            out.append(full)
    return out


def _before_reshapes(blocks: list[str], index: int, modules: dict[str, nn.Module]) -> str | None:
    """``blocks[index]``, or the block before it if it only reshapes (a flattened feature map is not pooled)."""
    while index >= 0 and isinstance(modules[blocks[index]], RESHAPES):
        index -= 1
    return blocks[index] if index >= 0 else None


def auto_sites(model: nn.Module, x: Inputs, *, head: str | nn.Module | None = None, count: int = 2) -> list[Site]:
    """The ends of the last ``count`` stages before the head, then the head's input (see module docs).

    ``x`` is an example batch (its first two rows are run once, in eval mode, to see the call order).
    """
    example = slice_inputs(x, 0, min(2, batch_size(x)))
    try:
        head_name, _ = find_head(model, head, example)
    except HeadNotFoundError as err:
        raise HeadNotFoundError(
            f"{err}. dac reads features at the head's input and before it; name the head with "
            "head=..., or the layers to read with layers=[module names]"
        ) from None
    called = _trace(model, example)
    if head_name not in called:
        raise HeadNotFoundError(
            f"the head '{head_name}' is not called in the forward pass; name the head with head=..."
        )
    opened: set[str] = set()
    ends: list[str] = []
    for _ in range(MAX_OPENINGS):
        blocks = sorted(
            (b for b in _blocks(model, "", head_name, called, opened) if called[b][0] < called[head_name][0]),
            key=lambda b: called[b][0],
        )
        modules = {b: model.get_submodule(b) for b in blocks}
        ends = [
            _before_reshapes(blocks, i, modules) for i in range(len(blocks) - 1) if _weighted(modules[blocks[i + 1]])
        ]
        ends = [b for b in ends if b is not None and called[b][1]]
        if len(ends) >= count:
            break
        openable = [b for b in blocks if b not in opened and any(True for _ in modules[b].children())]
        if not openable:
            break
        opened.add(max(openable, key=lambda b: sum(p.numel() for p in modules[b].parameters())))
    return [Site(name) for name in ends[-count:]] + [Site(head_name, "input")]


def named_sites(model: nn.Module, names: list[str], *, head: str | nn.Module | None, x: Inputs) -> list[Site]:
    """The outputs of the modules ``names``, then the head's input where a head can be found."""
    sites = [Site.parse(name) for name in names]
    for site in sites:
        get_submodule(model, site.name)
    try:
        head_name, _ = find_head(model, head, slice_inputs(x, 0, min(2, batch_size(x))))
    except HeadNotFoundError:
        return sites
    head_input = Site(head_name, "input")
    return sites if head_input in sites else sites + [head_input]


def position_sites(model: nn.Module, x: Inputs, *, head: str | nn.Module | None = None) -> list[Site]:
    """The head's input alone, for a row model of dense outputs whose batches ``x`` give one row per kept position
    (:data:`~posthoc.core.inputs.KEEP`): that input must be one feature row per kept position, as the per-position
    head of :mod:`posthoc.engine.dense_head` receives it. Intermediate feature maps are not read: pooled over the
    positions they would give one row per input, not per position.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.core.inputs import KEEP
        >>> from posthoc.methods.dac.layers import position_sites
        >>> rows = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))   # a row model: one row per position
        >>> [str(s) for s in position_sites(rows, torch.randn(6, 4))]
        ['2:input']
    """
    example = slice_inputs(x, 0, min(2, batch_size(x)))
    try:
        head_name, module = find_head(model, head, example)
    except HeadNotFoundError as err:
        raise HeadNotFoundError(f"{err}. dac on dense outputs reads the per-position head's input") from None
    found: list[Any] = []
    with torch.no_grad(), eval_mode(model), hooked([(module, "input", lambda m, args: found.append(args))]):
        run_model(model, example)
    value = first_tensor(found[0]) if found else None
    if value is None or value.dim() != 2 or value.shape[0] % max(1, label_rows(example)):
        raise HeadNotFoundError(
            f"dac on dense outputs needs a feature vector per position, the input of a per-position head (a 1x1 "
            f"nn.Conv2d or an nn.Linear as the network's last module); the input of '{head_name}' is not one row per "
            "position. Use method='temperature' or 'none' for this model"
        )
    return [Site(head_name, "input")]
