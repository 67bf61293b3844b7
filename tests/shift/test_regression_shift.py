"""Shift for regression: ``posthoc.shift.extrapolation_split`` / ``gap_split`` and ``posthoc.evaluate_shift`` on
named shifted test sets (and on corrupted images) for regressors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.evaluation.shift import REGRESSION_METRICS
from posthoc_apps.demo.data import WEIGHT_COLUMN, auto_mpg, train_mlp
from posthoc_apps.report import figures


def _rows(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=generator) * 4 - 2
    return x, torch.sin(x[:, :1]) + 0.03 * torch.randn(n, 1, generator=generator)


def _loader(pair: tuple[torch.Tensor, torch.Tensor]) -> DataLoader:
    return DataLoader(TensorDataset(*pair), batch_size=64)


# ----------------------------------------------------------------------------------------------- the splits


def test_extrapolation_split_holds_out_the_rows_above_the_quantile() -> None:
    x, y = _rows()
    split = posthoc.shift.extrapolation_split(x, y, feature=1, quantile=0.7)
    fit, shifted = split
    assert len(fit[0]) == 140 and len(shifted[0]) == 60  # int(0.7 * 200) lowest rows fit, no ties in random floats
    assert float(fit[0][:, 1].max()) == split.low < float(shifted[0][:, 1].min())
    assert torch.equal(shifted[1], y[split.shifted_index]) and split.high == float("inf")
    assert sorted(torch.cat([split.fit_index, split.shifted_index]).tolist()) == list(range(200))
    assert "feature 1 above" in repr(split) and "140 fit rows, 60 shifted" in repr(split)


def test_a_reference_takes_the_quantile_of_the_training_range() -> None:
    train_x, _ = _rows(seed=1)
    test_x, test_y = _rows(seed=2)
    split = posthoc.shift.extrapolation_split(test_x, test_y, feature=0, quantile=0.9, reference=train_x)
    threshold = float(train_x[:, 0].sort().values[179])  # the 180th of 200 training values
    assert split.low == threshold
    assert torch.equal(split.shifted_index.sort().values, torch.nonzero(test_x[:, 0] > threshold).squeeze(1))


def test_gap_split_holds_out_a_band_in_the_middle_with_fit_rows_on_both_sides() -> None:
    x, y = _rows()
    split = posthoc.shift.gap_split(x[:, 2], y, quantiles=(0.4, 0.6))  # a vector: one feature, none named
    band = x[split.shifted_index, 2]
    outside = x[split.fit_index, 2]
    assert len(band) == 40 and bool(((band > split.low) & (band <= split.high)).all())
    assert int((outside <= split.low).sum()) == 80 and int((outside > split.high).sum()) == 80
    assert split.fit[0].dim() == 1  # the rows keep the shape they came in


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda x, y: posthoc.shift.extrapolation_split(x, y), posthoc.ConfigError, "x has 3 features: name the one"),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x, y, feature=3),
            posthoc.ConfigError,
            "column index from 0 to 2",
        ),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x, y, feature=0, quantile=1.0),
            posthoc.ConfigError,
            "quantile must be a number strictly between 0 and 1",
        ),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x, y[:-1], feature=0),
            posthoc.InputError,
            "one target per row",
        ),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x[:, None], y, feature=0),
            posthoc.InputError,
            "for images use the corruption kinds",
        ),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x, y, feature=0, reference=x[:, :2]),
            posthoc.InputError,
            "reference must be rows with the 3 features",
        ),
        (
            lambda x, y: posthoc.shift.extrapolation_split(x, y, feature=0, quantile=0.5, reference=x + 10),
            posthoc.InputError,
            "leaves no shifted rows",
        ),
        (
            lambda x, y: posthoc.shift.gap_split(x, y, feature=0, quantiles=(0.6, 0.4)),
            posthoc.ConfigError,
            "low < high",
        ),
        (
            lambda x, y: posthoc.shift.gap_split(x, y, feature=0, quantiles=0.5),
            posthoc.ConfigError,
            "a pair (low, high)",
        ),
    ],
)
def test_bad_splits_are_refused_with_what_to_do(call, error, says) -> None:
    x, y = _rows()
    with pytest.raises(error, match=re.escape(says)):
        call(x, y)


def test_the_auto_mpg_shift_split_tests_on_random_heavy_and_middle_cars() -> None:
    data = auto_mpg(0, split="shift")
    heavy = auto_mpg(0, split="extrapolate")
    assert len(data.shifted["extrapolation"][0]) == 118  # the heaviest 30 % of 392
    # the same heavy cars as the extrapolate split, standardised on another training part: same order of weight
    assert torch.equal(
        data.shifted["extrapolation"][0][:, WEIGHT_COLUMN].argsort(), heavy.test[0][:, WEIGHT_COLUMN].argsort()
    )
    weight = lambda pair: pair[0][:, WEIGHT_COLUMN]  # noqa: E731
    gap = weight(data.shifted["gap"])
    assert float(weight(data.train).max()) < float(weight(data.shifted["extrapolation"]).min())
    fit_weights = torch.cat([weight(data.train), weight(data.val), weight(data.test)])
    assert bool(((fit_weights < gap.min()) | (fit_weights > gap.max())).all())  # no fit car inside the band
    assert list(data.shift_loaders()) == ["random", "extrapolation", "gap"]
    assert len(data.train[0]) + len(data.val[0]) + len(data.test[0]) + len(gap) + 118 == 392


# -------------------------------------------------------------------------------------------- evaluate_shift


@pytest.fixture(scope="module")
def regressors(one_thread) -> tuple[dict[str, posthoc.UncertainModel], dict[str, DataLoader]]:
    """An MLP trained on x in [-2, 0.8], wrapped plain and with Laplace; test sets in range, beyond and in a gap."""
    x, y = _rows(400)
    beyond = posthoc.shift.extrapolation_split(x, y, feature=0, quantile=0.7)
    fit_x, fit_y = beyond.fit
    middle = posthoc.shift.gap_split(fit_x, fit_y, feature=0, quantiles=(0.4, 0.6))
    rest_x, rest_y = middle.fit
    order = torch.randperm(len(rest_x), generator=torch.Generator().manual_seed(0))
    train, val, test = (order[:120], order[120:180], order[180:])
    net = train_mlp((rest_x[train], rest_y[train]), hidden=32, epochs=300, seed=0)
    loaders = {"train": _loader((rest_x[train], rest_y[train])), "val": _loader((rest_x[val], rest_y[val]))}
    models = {
        method: posthoc.wrap(net, method=method, likelihood="regression").fit(
            loaders["train"], loaders["val"], progress=False
        )
        for method in ("none", "laplace")
    }
    sets = {
        "random": _loader((rest_x[test], rest_y[test])),
        "extrapolation": _loader(beyond.shifted),
        "gap": _loader(middle.shifted),
    }
    return models, sets


def test_named_test_sets_give_the_regression_metrics_per_set_and_method(regressors, tmp_path) -> None:
    models, sets = regressors
    table = posthoc.evaluate_shift(models, sets, ci=0.9, bootstraps=200, progress=False)
    assert table.named and table.kinds == ("random", "extrapolation", "gap") and table.metrics == REGRESSION_METRICS
    direct = posthoc.evaluate(models["laplace"], sets["extrapolation"], progress=False)
    for metric in REGRESSION_METRICS:
        assert table.value("laplace", "extrapolation", 0, metric) == pytest.approx(getattr(direct, metric), rel=1e-9)
    # the plain predictive is homoscedastic: one 90 % width on every set; Laplace's widens beyond the data
    widths = {kind: table.value("none", kind, 0, "width_90") for kind in table.kinds}
    assert widths["extrapolation"] == pytest.approx(widths["random"], rel=1e-9)
    # (2 % wider here, seeded: a last-layer posterior of a tanh MLP grows slowly past the data)
    assert table.value("laplace", "extrapolation", 0, "width_90") > 1.01 * table.value(
        "laplace", "random", 0, "width_90"
    )
    low, high = table.intervals["laplace"]["gap"][0]["crps"]
    assert low < table.value("laplace", "gap", 0, "crps") < high
    markdown = table.to_markdown(detail=True)
    assert "**NLL** per test set" in markdown and "| method | random | extrapolation | gap |" in markdown
    assert "| laplace | extrapolation | " in markdown and "cov 90%" in markdown
    assert table.as_dict()["metrics"] == list(REGRESSION_METRICS)
    figure = figures.shift_plot(table, tmp_path / "shift.png")
    assert [tick.get_text() for tick in figure.axes[0].get_xticklabels()] == ["random", "extrapolation", "gap"]
    assert (tmp_path / "shift.png").stat().st_size > 10_000
    assert table.best_method() in ("none", "laplace")


def test_corruption_kinds_refuse_a_regressor_on_tabular_inputs(regressors) -> None:
    models, sets = regressors
    with pytest.raises(
        posthoc.InputError,
        match="this regressor's test inputs are \\(44, 3\\); for tabular, 1-D or token inputs pass named shifted test sets",
    ):
        posthoc.evaluate_shift(models["laplace"], sets["random"], kinds=["gaussian-noise"], progress=False)
    with pytest.raises(posthoc.ConfigError, match="leave out kinds, severities and normalization"):
        posthoc.evaluate_shift(models["laplace"], sets, kinds=["rotate"], progress=False)
    with pytest.raises(posthoc.ConfigError, match="a dict of non-empty names to loaders"):
        posthoc.evaluate_shift(models["laplace"], {}, progress=False)


def test_named_tables_refuse_what_needs_severities_or_a_classifier(regressors) -> None:
    models, sets = regressors
    table = posthoc.evaluate_shift({"none": models["none"]}, {"random": sets["random"]}, progress=False)
    with pytest.raises(posthoc.ConfigError, match="merge them"):
        posthoc.ShiftTable.join([table, table])
    with pytest.raises(posthoc.ConfigError, match="coverage and width instead"):
        table.confidence("none", "random", 0)
    with pytest.raises(posthoc.ConfigError, match="this table has no \\['ece'\\]"):
        table.to_markdown(["ece"])
    classifier = posthoc.wrap(nn.Linear(3, 2), method="none")
    with pytest.raises(posthoc.ConfigError, match="these models mix both"):
        posthoc.evaluate_shift([models["none"], classifier], {"random": sets["random"]}, progress=False)


def test_a_regressor_on_images_is_corrupted_like_a_classifier(one_thread) -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(48, 1, 8, 8, generator=generator)
    targets = images.mean((1, 2, 3))[:, None] * 4
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1))
    loader = DataLoader(TensorDataset(images, targets), batch_size=16)
    um = posthoc.wrap(net, method="laplace", likelihood="regression").fit(loader, loader, progress=False)
    table = posthoc.evaluate_shift(
        um, loader, kinds=["contrast"], severities=[5], ci=0.9, bootstraps=100, progress=False
    )
    corrupted = posthoc.evaluate(um, posthoc.shift.corrupt(loader, "contrast", 5), progress=False)
    assert table.value("laplace", "contrast", 5, "crps") == pytest.approx(corrupted.crps, rel=1e-9)
    assert table.value("laplace", "mean", 5, "crps") == pytest.approx(corrupted.crps, rel=1e-9)  # one kind
    low, high = table.intervals["laplace"]["mean"][5]["nll"]
    assert low < table.value("laplace", "mean", 5, "nll") < high
    assert "**CRPS**, mean over contrast" in table.to_markdown()
