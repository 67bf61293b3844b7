"""Shared fixtures: the bundled digits and checkpoint, small loaders, and the architecture zoo."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from hypothesis import settings
from torch import nn

from posthoc.core.threads import single_thread_if
from posthoc_apps.demo import data, zoo

# the tests mirror the packages in folders (tests/methods/, tests/engine/, tests/apps/, ...) and a test module imports
# another's helpers by its name (``from test_recipes import _write_images``): every folder is on the path, whichever
# test runs first (test file names stay unique across folders; tests/test_architecture.py checks it)
sys.path += [
    str(folder)
    for folder in sorted(Path(__file__).resolve().parent.rglob("*"))
    if folder.is_dir() and any(folder.glob("test_*.py")) and str(folder) not in sys.path
]

# TorchCP, the oracle of SAPS, clustered and weighted conformal, imports torchsort when it is imported, for its
# differentiable-sorting training losses only. torchsort ships no wheel and its source build needs torch inside pip's
# isolated build environment, so the README's test command installs TorchCP with --no-deps; the predictors and scores
# the tests compare against never call it, so where it is missing a stand-in whose functions raise is registered.
if importlib.util.find_spec("torchsort") is None:

    def _refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torchsort is not installed: only TorchCP's training losses use it, and no test does")

    _torchsort = types.ModuleType("torchsort")
    _torchsort.soft_rank = _torchsort.soft_sort = _refuse  # type: ignore[attr-defined]
    sys.modules["torchsort"] = _torchsort

# the same examples on every run, so CI never passes or fails by chance;
# HYPOTHESIS_PROFILE=explore draws new examples (with --hypothesis-seed to replay one run)
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# under pytest-xdist (the README's `-n auto`) each worker takes its share of the cores: torch's default of every core
# per process oversubscribes them, and the tests of many small ops then run several times slower
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # and the processes a test starts


def linear_data_regressor(rows: int, train: int, noise: float) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small tanh MLP fitted (Adam, 200 full-batch steps) to ``y = 2 x₁`` plus Gaussian noise of std ``noise`` on the
    first ``train`` of ``rows`` seeded rows; returns it in eval mode with every row's ``x`` ``(rows, 3)`` and ``y``
    ``(rows, 1)``. Tests import it (``from conftest import linear_data_regressor``)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 3, generator=generator)
    y = 2 * x[:, :1] + noise * torch.randn(rows, 1, generator=generator)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(200):
        optimiser.zero_grad()
        ((net(x[:train]) - y[:train]) ** 2).mean().backward()
        optimiser.step()
    return net.eval(), x, y


def rule_choice(record: dict, *, rank_without_shift: str = "order") -> str:
    """The candidate the selection step's rule picks, re-derived from a record (``um.summary()["selection"]``) alone,
    written apart from ``posthoc.engine.selection``: among the admissible candidates, those whose clean NLL is within
    max(GIVE_UP of the best admissible gain, the tolerance) of the best; of those the lowest ``shifted_ratio``, or
    without perturbed copies the last (``"order"``) or the lowest clean NLL (``"clean"``)."""
    from posthoc.engine.selection import GIVE_UP

    rows = [row for row in record["candidates"] if row["admissible"]]
    if not rows:  # nothing admissible: the most conservative candidate, said as a fallback
        return record["candidates"][0]["candidate"]
    best = min(row["clean_nll"] for row in rows)
    slack = max(GIVE_UP * max(record["plain"]["clean_nll"] - best, 0.0), record["tolerance"])
    kept = [row for row in rows if row["clean_nll"] <= best + slack + 1e-6]
    if any(row["shifted_ratio"] is not None for row in kept):
        return min(kept, key=lambda row: row["shifted_ratio"])["candidate"]
    if rank_without_shift == "clean":
        return min(kept, key=lambda row: row["clean_nll"])["candidate"]
    return kept[-1]["candidate"]


@pytest.fixture(scope="session")
def digits() -> data.DigitsSplits:
    return data.load_digits()


@pytest.fixture()
def digits_model() -> nn.Module:
    """A fresh copy of the bundled pretrained CNN (eval mode) for each test."""
    return zoo.pretrained()


@pytest.fixture(scope="session")
def loaders(digits: data.DigitsSplits) -> dict[str, torch.utils.data.DataLoader]:
    return {
        "fit": data.loader(digits.fit, batch_size=256),
        "calibration": data.loader(digits.calibration, batch_size=256),
        "test": data.loader(digits.test, batch_size=256),
        "ood": data.loader(digits.ood, batch_size=256),
    }


@pytest.fixture(scope="session")
def small(digits: data.DigitsSplits) -> dict:
    """512 fit and 256 calibration digits as loaders, and 200 test inputs: for many quick fits."""
    x, y = digits.fit.tensors
    cx, cy = digits.calibration.tensors
    return {
        "fit": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:512], y[:512]), batch_size=128),
        "val": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(cx[:256], cy[:256]), batch_size=128),
        "x": digits.test.tensors[0][:200],
    }


#: random-weight architectures at small input sizes: name -> (factory, input shape)
ARCHITECTURES = {
    "timm:resnet18": (lambda: timm.create_model("resnet18", num_classes=5), (2, 3, 32, 32)),
    "timm:efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", num_classes=5), (2, 3, 32, 32)),
    "timm:mobilenetv3_small_100": (lambda: timm.create_model("mobilenetv3_small_100", num_classes=5), (2, 3, 32, 32)),
    "timm:convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=5), (2, 3, 32, 32)),
    "timm:vit_tiny_patch16_224": (
        lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32),
        (2, 3, 32, 32),
    ),
    "tv:resnet18": (lambda: torchvision.models.resnet18(num_classes=5), (2, 3, 32, 32)),
    "tv:mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=5), (2, 3, 32, 32)),
    "tv:efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(num_classes=5), (2, 3, 32, 32)),
    "tv:densenet121": (lambda: torchvision.models.densenet121(num_classes=5), (2, 3, 32, 32)),
    "tv:convnext_tiny": (lambda: torchvision.models.convnext_tiny(num_classes=5), (2, 3, 32, 32)),
    "tv:vit_b_16": (lambda: torchvision.models.vit_b_16(image_size=32, num_classes=5), (2, 3, 32, 32)),
    "tv:swin_t": (lambda: torchvision.models.swin_t(num_classes=5), (2, 3, 32, 32)),
    "sequential": (
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 5)),
        (2, 3, 8, 8),
    ),
}


@pytest.fixture(params=sorted(ARCHITECTURES))
def architecture(request: pytest.FixtureRequest) -> tuple[str, nn.Module, torch.Tensor]:
    """Each architecture of the zoo, seeded, in eval mode, with an input batch."""
    torch.manual_seed(0)
    factory, shape = ARCHITECTURES[request.param]
    return request.param, factory().eval(), torch.randn(*shape)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: D103
    try:
        import test_fuzz
    except ImportError:
        return
    if test_fuzz.CASES:
        terminalreporter.write_line(
            f"fuzz cases tried per method: {dict(test_fuzz.CASES)} (total {sum(test_fuzz.CASES.values())})"
        )
        terminalreporter.write_line(f"fuzz outcomes: {dict(sorted(test_fuzz.OUTCOMES.items()))}")


@pytest.fixture(scope="module")
def one_thread():
    """Tests of many tiny tensor ops run on one thread: several only fight over a busy CPU (10x slower)."""
    with single_thread_if(True):
        yield
