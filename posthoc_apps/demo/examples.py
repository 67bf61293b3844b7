"""Small ready-made models, data and results for trying posthoc in a notebook: what the docstring examples import.

Every docstring example in posthoc starts from plain imports, so it runs as pasted. The objects it needs are
imported from here, by name, and built on first use (a few seconds, once per process):

    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader
    >>> um = posthoc.wrap(model, method="laplace").fit(train_loader, val_loader, progress=False)

Classification (:func:`blobs`): three overlapping Gaussian classes in four features.

- ``model``: ``nn.Sequential(Linear(4, 64), ReLU(), Dropout(0.1), Linear(64, 3))`` in eval mode, fitted (300
  full-batch Adam steps); like many real networks it is overconfident (its temperature is about 2). Its head is ``"3"``;
- ``train_loader`` (256 examples), ``val_loader`` and its alias ``calibration_loader`` (128), ``test_loader`` (128),
  ``ood_loader`` (128 inputs far from the classes, labelled ``-1``) and ``noisy_loader`` (the test inputs plus Gaussian
  noise of std 1, a covariate shift): batches of 64 ``(x, y)``;
- ``x``, ``y``: the first eight test inputs ``(8, 4)`` and their labels ``(8,)``;
- ``logits``, ``probs``, ``labels`` (also ``val_logits``, ``val_probs``, ``val_labels``): the model's logits, softmax
  probabilities ``(128, 3)`` and labels on the validation set; ``test_logits``, ``test_probs``, ``test_labels`` on the
  test set;
- ``net_a``, ``net_b``, ``net_c``: three more classifiers of ``model``'s architecture from other seeds (100 steps),
  the members of a deep ensemble;
- ``um``: ``posthoc.wrap(model, method="laplace").fit(train_loader, val_loader)``;
- ``report``, ``noisy_report``: ``posthoc.evaluate(um, test_loader, ood_loader)`` and ``posthoc.evaluate(um,
  noisy_loader)``; ``plain_report``, ``plain_noisy_report``: the same of ``posthoc.wrap(model, method="none")``;
  ``verdict``: their :func:`~posthoc.evaluation.comparison.compared_verdict`.

Regression (:func:`posthoc_apps.demo.data.sinusoid`, one input feature):

- ``regressor``: :func:`posthoc_apps.demo.data.train_mlp` (hidden width 16) on the sinusoid's 40 training points;
- ``reg_train_loader`` (40 points), ``reg_val_loader`` (40), ``reg_test_loader`` (420); ``reg_x``, ``reg_y``: the first
  eight test inputs and targets ``(8, 1)``;
- ``regression_um``: ``posthoc.wrap(regressor, method="laplace", likelihood="regression")`` fitted on them.

Digits (the bundled MNIST digits, :mod:`posthoc_apps.demo.data`):

- ``digits``: :func:`posthoc_apps.demo.data.load_digits`; ``cnn``: the bundled CNN (:func:`posthoc_apps.demo.zoo.pretrained`);
  ``digits_test_loader``: the first 200 test digits in one batch;
- ``shift_table``: the :class:`~posthoc.evaluation.shift.ShiftTable` of the plain CNN (``"MAP"``) and its Laplace
  posterior (fitted on 600 + 200 digits) under Gaussian noise and rotation at severities 1, 3 and 5.

Models and fitted wrappers come as fresh copies on every import, so changing one never changes another's; the
rest is shared (treat it as read-only). Each object is built under ``torch.manual_seed(0)`` on one thread, so its
numbers are the same on every run and every CPU, and the global random state is left as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.evaluation.comparison import compared_verdict
from posthoc_apps.demo import data as digits_data
from posthoc_apps.demo.data import sinusoid, train_mlp
from posthoc_apps.demo.zoo import pretrained

__all__ = ["Blobs", "blobs", "NAMES"]

_BUILDERS: dict[str, Callable[[], Any]] = {}
#: the names whose objects change in place (models, fitted wrappers): a fresh copy on every import
_COPIED = {"model", "net_a", "net_b", "net_c", "um", "regressor", "regression_um", "cnn"}
_CACHE: dict[str, Any] = {}


def _seeded(build: Callable[[], Any]) -> Any:
    """Run ``build`` under seed 0 on one torch thread; restore the random state and the thread count."""
    state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        return build()
    finally:
        torch.random.set_rng_state(state)
        torch.set_num_threads(threads)


def _get(name: str) -> Any:
    if name not in _CACHE:
        _CACHE[name] = _seeded(_BUILDERS[name])
    return _CACHE[name]


def _builder(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def register(build: Callable[[], Any]) -> Callable[[], Any]:
        _BUILDERS[name] = build
        return build

    return register


@dataclasses.dataclass(frozen=True)
class Blobs:
    """Three overlapping Gaussian classes in four features and the classifier trained on them.

    ``sets``, ``loaders`` and ``logits`` map ``"train"`` (256 examples), ``"val"`` (128), ``"test"`` (128) and
    ``"ood"`` (128 inputs far from the classes, labelled ``-1``) to ``(x, y)`` tensors, to loaders of batches of 64
    and to ``model``'s logits."""

    model: nn.Module
    sets: dict[str, tuple[Tensor, Tensor]]
    loaders: dict[str, DataLoader]
    logits: dict[str, Tensor]


@functools.lru_cache(maxsize=1)
def blobs() -> Blobs:
    """The classification data and its trained model (module docs), built once: seed 0, trained in float64 so
    every CPU gets the same weights. Shared: treat it as read-only, or import a copy of ``model`` from here.

    Example:
        >>> from posthoc_apps.demo.examples import blobs
        >>> data = blobs()
        >>> data.sets["train"][0].shape, len(data.loaders["test"].dataset), data.model(data.sets["val"][0]).shape
        (torch.Size([256, 4]), 128, torch.Size([128, 3]))
    """
    return _seeded(_train_blobs)


def _train_blobs() -> Blobs:
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])

    def draw(count: int) -> tuple[Tensor, Tensor]:
        labels = torch.arange(count) % 3
        labels = labels[torch.randperm(count, generator=generator)]
        return centres[labels] + torch.randn(count, 4, generator=generator), labels

    sets = {name: draw(count) for name, count in (("train", 256), ("val", 128), ("test", 128))}
    sets["ood"] = (6.0 + 2.0 * torch.randn(128, 4, generator=generator), torch.full((128,), -1))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3)).double()
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, labels = sets["train"]
    for _ in range(300):  # in float64: every CPU trains the same weights (float32 sums differ in the last bits)
        optimiser.zero_grad()
        nn.functional.cross_entropy(net(x.double()), labels).backward()
        optimiser.step()
    net.float().eval()
    with torch.no_grad():
        logits = {name: net(pair[0]) for name, pair in sets.items()}
    loaders = {name: DataLoader(TensorDataset(*pair), batch_size=64) for name, pair in sets.items()}
    return Blobs(model=net, sets=sets, loaders=loaders, logits=logits)


@functools.lru_cache(maxsize=1)
def _sinusoid() -> dict[str, Any]:
    def build() -> dict[str, Any]:
        data = sinusoid()
        return {"data": data, "model": train_mlp(data.train, hidden=16, epochs=300, seed=0)}

    return _seeded(build)


_builder("model")(lambda: blobs().model)
for _name, _split in (
    ("train_loader", "train"),
    ("val_loader", "val"),
    ("calibration_loader", "val"),
    ("test_loader", "test"),
    ("ood_loader", "ood"),
):
    _builder(_name)(lambda split=_split: blobs().loaders[split])
_builder("x")(lambda: blobs().sets["test"][0][:8].clone())
_builder("y")(lambda: blobs().sets["test"][1][:8].clone())
for _prefix, _split in (("", "val"), ("val_", "val"), ("test_", "test")):
    _builder(f"{_prefix}logits")(lambda split=_split: blobs().logits[split].clone())
    _builder(f"{_prefix}probs")(lambda split=_split: blobs().logits[split].softmax(-1))
    _builder(f"{_prefix}labels")(lambda split=_split: blobs().sets[split][1].clone())


def _member(seed: int) -> nn.Module:
    x, labels = blobs().sets["train"]
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3))
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(100):
        optimiser.zero_grad()
        nn.functional.cross_entropy(net(x), labels).backward()
        optimiser.step()
    return net.eval()


for _name, _seed in (("net_a", 1), ("net_b", 2), ("net_c", 3)):
    _builder(_name)(lambda seed=_seed: _member(seed))


@_builder("um")
def _um() -> Any:
    loaders = blobs().loaders
    return posthoc.wrap(blobs().model, method="laplace").fit(loaders["train"], loaders["val"], progress=False)


@_builder("noisy_loader")
def _noisy_loader() -> DataLoader:
    x, labels = blobs().sets["test"]
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x + noise, labels), batch_size=64)


def _evaluated(plain: bool, loader: str, ood: bool) -> Any:
    um = posthoc.wrap(blobs().model, method="none") if plain else _get("um")
    return posthoc.evaluate(um, _get(loader), _get("ood_loader") if ood else None, progress=False)


for _name, _plain, _loader, _ood in (
    ("report", False, "test_loader", True),
    ("noisy_report", False, "noisy_loader", False),
    ("plain_report", True, "test_loader", True),
    ("plain_noisy_report", True, "noisy_loader", False),
):
    _builder(_name)(lambda plain=_plain, loader=_loader, ood=_ood: _evaluated(plain, loader, ood))


@_builder("verdict")
def _verdict() -> Any:
    return compared_verdict(
        [_get("plain_report"), _get("report")], {"noisy": [_get("plain_noisy_report"), _get("noisy_report")]}
    )


_builder("regressor")(lambda: _sinusoid()["model"])
for _name, _part, _size in (
    ("reg_train_loader", "train", 64),
    ("reg_val_loader", "val", 256),
    ("reg_test_loader", "test", 256),
):
    _builder(_name)(lambda part=_part, size=_size: getattr(_sinusoid()["data"], f"{part}_loader")(size))
_builder("reg_x")(lambda: _sinusoid()["data"].test[0][:8].clone())
_builder("reg_y")(lambda: _sinusoid()["data"].test[1][:8].clone())


@_builder("regression_um")
def _regression_um() -> Any:
    data = _sinusoid()["data"]
    return posthoc.wrap(_sinusoid()["model"], method="laplace", likelihood="regression").fit(
        data.train_loader(), data.val_loader(), progress=False
    )


@_builder("digits")
def _digits() -> Any:
    return digits_data.load_digits()


@_builder("cnn")
def _cnn() -> nn.Module:
    return pretrained()


@_builder("digits_test_loader")
def _digits_test_loader() -> DataLoader:
    return digits_data.loader(digits_data.subset(_get("digits").test, 200), batch_size=200)


@_builder("shift_table")
def _shift_table() -> Any:
    digits, cnn = _get("digits"), _get("cnn")
    laplace = posthoc.wrap(cnn, method="laplace").fit(
        digits_data.loader(digits_data.subset(digits.fit, 600)),
        digits_data.loader(digits_data.subset(digits.calibration, 200)),
        progress=False,
    )
    return posthoc.evaluate_shift(
        {"MAP": posthoc.wrap(cnn, method="none"), "laplace": laplace},
        _get("digits_test_loader"),
        kinds=["gaussian-noise", "rotate"],
        severities=[1, 3, 5],
        normalization=((digits_data.MEAN,), (digits_data.STD,)),
        progress=False,
    )


#: every name this module hands out (``from posthoc_apps.demo.examples import NAME``)
NAMES: tuple[str, ...] = tuple(_BUILDERS)


def __getattr__(name: str) -> Any:
    """``from posthoc_apps.demo.examples import model``: build ``name`` on first use; a fresh copy of a model."""
    if name not in _BUILDERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it offers {', '.join(NAMES)}")
    value = _get(name)
    return copy.deepcopy(value) if name in _COPIED else value


def __dir__() -> list[str]:
    return sorted([*globals(), *NAMES])
