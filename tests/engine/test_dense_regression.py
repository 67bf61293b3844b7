"""Per-position regression (``posthoc.wrap(model, dense=True, likelihood="regression")``): a small network that
regresses a smoothed copy of its digit canvas at every pixel (a stand-in for depth), NaN where there is no target."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import posthoc
from posthoc.errors import PosthocError
from posthoc_apps.demo.segmentation import trained_pixel_regressor


@pytest.fixture(scope="module")
def task():
    net, sets = trained_pixel_regressor()
    return net, [DataLoader(s, batch_size=32) for s in sets], sets[2]


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


def _coverage(pred, targets):
    rows = targets.movedim(1, -1).reshape(-1, 1)
    keep = torch.isfinite(rows).all(-1)
    low, high = pred.interval(0.9)
    return float(((rows >= low) & (rows <= high))[keep].float().mean())


#: a noise std eight times too small for the network's residuals (about 0.16 on these pixels)
TOO_SMALL = 0.02


@pytest.mark.parametrize("method", ["variance-scaling", ["laplace", "variance-scaling"]])
def test_variance_scaling_per_pixel_fixes_a_noise_set_too_small(task, method):
    net, (train, val, _), test = task
    images, targets = test.tensors
    fixed = posthoc.Gaussian(noise_std=TOO_SMALL)
    plain = posthoc.wrap(net, method="none", dense=True, likelihood=fixed).fit(train, val, progress=False)
    um = posthoc.wrap(net, method=method, dense=True, likelihood=fixed).fit(train, val, progress=False)
    fitted = posthoc.wrap(net, method="none", dense=True, likelihood="regression").fit(train, val, progress=False)
    assert _coverage(plain.predict(images), targets) < 0.5
    pred = um.predict(images)
    # the network's residuals are not Gaussian with one std everywhere (they differ between strokes and background),
    # so a Gaussian of the right variance covers 0.85-0.95 of them, as `none` with its fitted noise does (49,152 pixels)
    assert 0.85 <= _coverage(pred, targets) <= 0.95
    card = um.summary()["calibration"]
    assert card["chosen"] == "variance-scaling" and card["scale"][0] > 5
    if method == "variance-scaling":  # s² = mean(r²) / 0.02² on the valid held-out pixels: the noise `none` fits there
        torch.testing.assert_close(pred.std, fitted.predict(images).std, rtol=1e-5, atol=0)


def test_auto_takes_variance_scaling_where_it_plainly_helps_and_keeps_none_where_not(task, monkeypatch):
    from posthoc.methods.calibration import per_position

    net, (train, val, _), test = task
    seen = []

    def spy(candidates, scores, *, plain, **options):
        seen.append(plain.units)
        return select(candidates, scores, plain=plain, **options)

    select = per_position.select
    monkeypatch.setattr(per_position, "select", spy)
    images, targets = test.tensors
    chosen = {}
    for label, likelihood in (("set too small", posthoc.Gaussian(noise_std=TOO_SMALL)), ("fitted", "regression")):
        um = posthoc.wrap(net, method="auto", dense=True, likelihood=likelihood).fit(train, val, progress=False)
        chosen[label] = um.summary()["calibration"]
    assert chosen["set too small"]["chosen"] == "variance-scaling"
    assert 0.85 <= _coverage(um.predict(images), targets) <= 0.95
    # with the noise fitted on these pixels, variance scaling's factor is 1 on them: no gain to take
    assert chosen["fitted"]["chosen"] == "none"
    # the unit of the bound is the image: 64 validation canvases of 30 x 32 valid pixels (two rows without targets)
    for units in seen:
        assert torch.equal(units, torch.arange(64).repeat_interleave(30 * 32))
    assert chosen["fitted"]["selection"]["folds"] == 5 and chosen["fitted"]["selection"]["examples"] == 64 * 30 * 32


@pytest.mark.parametrize("method", ["auto", ["laplace", "variance-scaling"], "isotonic"])
def test_a_calibrated_per_pixel_regressor_saves_and_loads(task, tmp_path, method):
    net, (train, val, _), test = task
    fixed = posthoc.Gaussian(noise_std=0.05)
    um = posthoc.wrap(net, method=method, dense=True, likelihood=fixed).fit(train, val, progress=False)
    path = tmp_path / "depth.pt"
    um.save(str(path))
    loaded = posthoc.load(str(path), net)
    images = test.tensors[0][:4]
    before, after = um.predict(images), loaded.predict(images)
    assert loaded.summary()["calibration"] == um.summary()["calibration"]
    for low, high in zip(before.interval(0.9), after.interval(0.9)):
        assert torch.equal(low, high)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))
    with pytest.raises(PosthocError, match="different model"):
        posthoc.load(str(path), other)


def test_isotonic_per_pixel_is_scored_by_its_own_predictive(task):
    net, (train, val, test_loader), test = task
    fixed = posthoc.Gaussian(noise_std=0.05)  # about three times too small
    um = posthoc.wrap(net, method="isotonic", dense=True, likelihood=fixed).fit(train, val, progress=False)
    images, targets = test.tensors
    pred = um.predict(images)
    assert pred.recalibrated and 0.85 <= _coverage(pred, targets) <= 0.95  # as variance scaling's, above
    assert um.methods == ["none", "isotonic"]
    row = posthoc.evaluate(um, test_loader).rows["none+isotonic"]
    rows = targets.movedim(1, -1).reshape(-1, 1)
    keep = torch.isfinite(rows).all(-1)
    expected = (
        -pred.log_prob(torch.nan_to_num(rows))[keep].double().mean()
    )  # the recalibrated density, not the Gaussian
    assert row["NLL"] == pytest.approx(float(expected), rel=1e-9) and row["coverage 90%"] == pytest.approx(
        _coverage(pred, targets)
    )
    assert math.isnan(row["mean std"])


def test_a_calibrator_goes_last_in_a_per_pixel_chain(task):
    net = task[0]
    for method in (["variance-scaling", "laplace"], ["laplace", "mc-dropout"], ["isotonic", "auto"]):
        with pytest.raises(PosthocError, match="followed by a calibrator"):
            posthoc.wrap(net, method=method, dense=True, likelihood="regression")
    with pytest.raises(PosthocError, match="fitted on held-out positions"):
        posthoc.wrap(net, method="variance-scaling", dense=True, likelihood="regression").fit(task[1][0])
