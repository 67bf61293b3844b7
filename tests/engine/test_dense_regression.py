"""Per-position regression (``posthoc.wrap(model, dense=True, likelihood="regression")``): a small network that
regresses a smoothed copy of its digit canvas at every pixel (a stand-in for depth), NaN where there is no target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import PosthocError
from posthoc_apps.demo.segmentation import segmentation_data

NOISE = 0.1


def _targets(images: torch.Tensor, seed: int) -> torch.Tensor:
    noise = NOISE * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    targets = F.avg_pool2d(images, 5, 1, 2) * 2 + noise
    targets[..., :2, :] = float("nan")  # the top rows have no target
    return targets


@pytest.fixture(scope="module")
def task():
    data = segmentation_data(train=128, val=64, test=64)
    sets = [
        TensorDataset(d.tensors[0], _targets(d.tensors[0], i)) for i, d in enumerate((data.train, data.val, data.test))
    ]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.1),
        nn.Conv2d(8, 1, 1),
    )  # fmt: skip
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(8):
        for x, t in DataLoader(sets[0], batch_size=32, shuffle=True):
            keep = torch.isfinite(t)
            loss = (net(x) - torch.nan_to_num(t))[keep].pow(2).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return net.eval(), [DataLoader(s, batch_size=32) for s in sets], sets[2]


@pytest.mark.parametrize("method", ["none", "laplace"])
def test_per_pixel_intervals_cover_and_the_fields_shape_back(task, method):
    net, (train, val, _), test = task
    um = posthoc.wrap(net, method=method, dense=True, likelihood="regression").fit(train, val, progress=False)
    images, targets = test.tensors
    pred = um.predict(images)
    assert pred.mean.shape == (64 * 32 * 32, 1)  # a row per position
    with torch.no_grad():
        assert torch.allclose(um.maps(pred.mean, targets.shape), net(images), atol=1e-5)  # the mean is the network's
    rows = targets.movedim(1, -1).reshape(-1, 1)
    keep = torch.isfinite(rows).all(-1)
    low, high = pred.interval(0.9)
    coverage = float(((rows >= low) & (rows <= high))[keep].float().mean())
    assert 0.85 <= coverage <= 0.95  # the noise fitted on the valid validation pixels; 49,152 test pixels
    if method == "laplace":
        assert um.summary()["posterior"][0]["fit_examples"] == int(torch.isfinite(train.dataset.tensors[1]).sum())
        assert float(pred.epistemic.mean()) > 0


def test_posthoc_evaluate_measures_a_per_pixel_regressor(task):
    net, (train, val, test_loader), _ = task
    um = posthoc.wrap(net, method="mc-dropout", dense=True, likelihood="regression", p=0.1, num_samples=8)
    report = posthoc.evaluate(um.fit(train, val, progress=False), test_loader)
    row = report.rows["mc-dropout"]
    assert set(row) == {"NLL", "RMSE", "coverage 90%", "width 90%", "mean std"}
    assert 0.8 <= row["coverage 90%"] <= 1.0 and row["RMSE"] < 0.3
    assert report.positions == int(torch.isfinite(test_loader.dataset.tensors[1]).sum())


def test_targets_of_another_shape_and_classification_methods_are_refused(task):
    net, (train, val, _), _ = task
    images, targets = val.dataset.tensors
    with pytest.raises(PosthocError, match="targets .* do not match the outputs"):
        posthoc.wrap(net, method="none", dense=True, likelihood="regression").fit(
            None, [(images, targets[:, 0])], progress=False
        )
    with pytest.raises(PosthocError, match="does not work on dense regression outputs yet"):
        posthoc.wrap(net, method="temperature", dense=True, likelihood="regression")
