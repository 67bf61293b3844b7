"""Building a classifier from a short spec, and loading a checkpoint into it with clear errors.

A spec names where the architecture comes from:

- ``"timm:NAME"``: ``timm.create_model(NAME, pretrained=...)``;
- ``"torchvision:NAME"`` (or ``"tv:NAME"``): ``torchvision.models.get_model(NAME, weights="DEFAULT" or None)``;
- ``"path/to/file.py:factory"``: ``factory()`` from that file (given ``pretrained`` / ``num_classes``
  if it accepts them).

``--checkpoint`` files hold a ``state_dict`` (optionally under ``"state_dict"``, ``"model"``,
``"model_state_dict"`` or ``"state_dict_ema"``; a DistributedDataParallel ``module.`` prefix is
stripped). A checkpoint that does not fit the architecture is refused with the missing,
unexpected and mis-shaped keys listed.

Example:
    >>> from posthoc_apps.loading.models import build_model
    >>> model = build_model("timm:resnet18", pretrained=False, num_classes=10)
    >>> model = build_model("torchvision:resnet50", checkpoint="finetuned.pth", pretrained=False)  # doctest: +SKIP
    >>> model = build_model("my_models.py:make_net")  # a model file  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from posthoc.core.checkpoint import load_checkpoint
from posthoc.errors import ConfigError

SOURCES = ("timm", "torchvision")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec: ``source`` is ``"timm"``, ``"torchvision"`` or ``"file"``."""

    source: str
    name: str
    path: Path | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.name}" if self.source == "file" else f"{self.source}:{self.name}"


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse ``"timm:NAME"``, ``"torchvision:NAME"`` (``"tv:NAME"``) or ``"file.py:factory"``.

    Example:
        >>> from posthoc_apps.loading.models import parse_model_spec
        >>> parse_model_spec("tv:resnet50")
        ModelSpec(source='torchvision', name='resnet50', path=None)
    """
    prefix, sep, name = spec.rpartition(":")
    if not sep or not prefix or not name:
        raise ConfigError(
            f"model spec {spec!r} is not understood; use 'timm:NAME' (e.g. timm:resnet50), "
            "'torchvision:NAME' (e.g. torchvision:resnet50) or 'path/to/file.py:factory'"
        )
    if prefix in ("timm", "torchvision", "tv"):
        return ModelSpec("torchvision" if prefix == "tv" else prefix, name)
    if not prefix.endswith(".py"):
        raise ConfigError(
            f"model spec {spec!r}: the part before ':' must be 'timm', 'torchvision' or a .py file, got {prefix!r}"
        )
    return ModelSpec("file", name, Path(prefix))


@contextmanager
def fetching_weights(spec: str | ModelSpec) -> Iterator[None]:
    """Turn a failed download of published weights (offline machine, empty cache) into a clear :class:`ConfigError`.

    Example:
        >>> with fetching_weights("timm:resnet50"):  # downloads weights  # doctest: +SKIP
        ...     model = timm.create_model("resnet50", pretrained=True)
    """
    try:
        yield
    except OSError as err:  # no network / no cache: huggingface_hub and urllib errors are OSErrors
        raise ConfigError(
            f"could not fetch the pretrained weights of {spec}: {type(err).__name__}: {str(err)[:200]}. Run where "
            "they can be downloaded or are cached (HF_HOME for timm, TORCH_HOME for torchvision), or pass "
            "--pretrained false with --checkpoint FILE"
        ) from err


def model_options(spec: str | ModelSpec, pretrained: bool, num_classes: int | None) -> dict[str, Any]:
    """The keyword arguments that give the architecture of ``spec`` a ``num_classes`` head, once its name is checked.

    Refuses a timm or torchvision name the library does not have (listing similar names), and a head
    size other than that of torchvision's pretrained weights.

    Example:
        >>> from posthoc_apps.loading.models import model_options
        >>> model_options("tv:resnet18", pretrained=False, num_classes=10)
        {'num_classes': 10}
    """
    spec = parse_model_spec(spec) if isinstance(spec, str) else spec
    if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 1):
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}")
    if spec.source == "timm":
        _check_timm_name(spec.name)
    elif spec.source == "torchvision":
        _check_torchvision_name(spec.name)
        if pretrained and num_classes is not None:
            _check_torchvision_pretrained_head(spec.name, num_classes)
            return {}
    return {} if num_classes is None else {"num_classes": num_classes}


def _check_timm_name(name: str) -> None:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('.')[0][:6]}*")[:10]
        raise ConfigError(f"timm has no model {name!r}; similar names: {close or 'none'} (see timm.list_models())")


def _check_torchvision_name(name: str) -> None:
    import torchvision

    available = torchvision.models.list_models()
    if name not in available:
        close = [n for n in available if name[:4] in n][:10]
        raise ConfigError(f"torchvision has no model {name!r}; similar names: {close or 'none'}")


def _check_torchvision_pretrained_head(name: str, num_classes: int) -> None:
    import torchvision

    default = len(torchvision.models.get_model_weights(name).DEFAULT.meta["categories"])
    if num_classes != default:
        raise ConfigError(
            f"torchvision's pretrained {name} has {default} classes, not {num_classes}; load your fine-tuned "
            "weights with --pretrained false --num-classes N --checkpoint FILE"
        )


def _timm_model(spec: ModelSpec, pretrained: bool, num_classes: int | None) -> nn.Module:
    import timm

    options = model_options(spec, pretrained, num_classes)
    with fetching_weights(spec):
        return timm.create_model(spec.name, pretrained=pretrained, **options)


def _torchvision_model(spec: ModelSpec, pretrained: bool, num_classes: int | None) -> nn.Module:
    import torchvision

    options = model_options(spec, pretrained, num_classes)
    with fetching_weights(spec):
        return torchvision.models.get_model(spec.name, weights="DEFAULT" if pretrained else None, **options)


def _factory_model(spec: ModelSpec, pretrained: bool, num_classes: int | None) -> nn.Module:
    path, name = spec.path, spec.name
    options = model_options(spec, pretrained, num_classes)
    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist; pass 'path/to/file.py:factory'")
    module_name = f"posthoc_user_model_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(f"{path} has no callable {name!r}; callables there: {names}")
    accepted = inspect.signature(factory).parameters
    if options and "num_classes" not in accepted:
        raise ConfigError(f"{path}:{name} takes no num_classes argument; drop --num-classes")
    model = factory(**options, **({"pretrained": pretrained} if "pretrained" in accepted else {}))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{path}:{name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(
    spec: str | ModelSpec,
    *,
    pretrained: bool = True,
    num_classes: int | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> nn.Module:
    """Build the classifier named by ``spec`` (see module docs), load ``checkpoint`` if given, in eval mode.

    ``pretrained=True`` downloads the published weights (timm: Hugging Face hub; torchvision: the
    weights' URL), so it needs internet or a filled cache; ``pretrained=False`` gives random weights.

    Example:
        >>> model = build_model("timm:resnet50")                     # ImageNet weights  # doctest: +SKIP
        >>> model = build_model("tv:resnet18", pretrained=False, num_classes=10, checkpoint="ckpt.pth")  # doctest:+SKIP
    """
    spec = parse_model_spec(spec) if isinstance(spec, str) else spec
    if spec.source == "timm":
        model = _timm_model(spec, pretrained, num_classes)
    elif spec.source == "torchvision":
        model = _torchvision_model(spec, pretrained, num_classes)
    else:
        model = _factory_model(spec, pretrained, num_classes)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=str(spec))
    return model.eval()
