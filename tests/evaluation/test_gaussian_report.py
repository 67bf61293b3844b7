"""``posthoc.evaluate`` for a regressor: the Gaussian report's metrics, bootstrap intervals, Markdown, HTML and
pictures, conformal intervals measured on the test set, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from test_regression import _trained_mlp
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError
from posthoc.evaluation import gaussian_metrics
from posthoc.evaluation.gaussian_report import Gaussian
from posthoc.evaluation.report import Report
from posthoc_apps.report import figures
from posthoc_apps.report import page as html_page


@pytest.fixture(scope="module")
def two_outputs() -> tuple[posthoc.UncertainModel, DataLoader, torch.Tensor, torch.Tensor]:
    """A two-output regressor (last-layer Laplace) and a test loader of 120 fresh examples."""
    net, loader, _ = _trained_mlp(outputs=2)
    um = posthoc.wrap(net, method="laplace", likelihood="regression").fit(loader, progress=False)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(120, 3, generator=generator)
    y = torch.stack([2 * x[:, 0], x[:, 1] - x[:, 2]], 1) + 0.4 * torch.randn(120, 2, generator=generator)
    return um, DataLoader(TensorDataset(x, y), batch_size=50), x, y


def test_evaluate_a_regressor_gives_the_metrics_of_its_predictive(two_outputs) -> None:
    um, loader, x, y = two_outputs
    report = posthoc.evaluate(um, loader, progress=False)
    assert report.kind == "gaussian" and report.name == "laplace"
    means, stds = gaussian_metrics.components(um.predict(x))
    # the loader's batches against one predict of all inputs: float32 forward passes of different batch sizes
    close = {"rel": 1e-5, "abs": 1e-6}
    assert report.rmse == pytest.approx(gaussian_metrics.rmse(means, y), **close)
    assert report.mae == pytest.approx(gaussian_metrics.mae(means, y), **close)
    assert report.nll == pytest.approx(gaussian_metrics.nll(means, stds, y), **close)
    assert report.crps == pytest.approx(gaussian_metrics.crps(means, stds, y), **close)
    for level, name in ((0.5, "50"), (0.9, "90"), (0.95, "95")):
        coverage, width = gaussian_metrics.interval_coverage(means, stds, y, level)
        assert getattr(report, f"coverage_{name}") == pytest.approx(coverage, abs=1 / 240 + 1e-12)  # one point of 240
        assert getattr(report, f"width_{name}") == pytest.approx(width, **close)
    assert report.mace == pytest.approx(gaussian_metrics.calibration_error(means, stds, y), abs=2 / 240)
    assert report.ence == pytest.approx(gaussian_metrics.ence(means, stds, y), rel=1e-4)
    assert 0.8 < report.coverage_90 <= 1 and report.coverage is None and report.intervals == {}
    assert set(report.as_dict()) == set(Gaussian.COLUMNS)


def test_bootstrap_statistics_are_the_metrics_of_the_resampled_examples(two_outputs) -> None:
    um, loader, _, _ = two_outputs
    report = posthoc.evaluate(um, loader, progress=False)
    means, stds, y = report.means, report.stds, report.targets
    stats = gaussian_metrics.statistics(means, stds, y)
    assert set(stats) == set(Gaussian.COLUMNS)
    whole = torch.arange(len(y))[None]
    picks = torch.randint(len(y), (3, len(y)), generator=torch.Generator().manual_seed(0))
    for name, statistic in stats.items():  # exact but for float64 summation order
        assert float(statistic(whole)[0]) == pytest.approx(getattr(report, name), rel=1e-12, abs=1e-12), name
        values = statistic(picks)
        for row, index in enumerate(picks):
            resampled = Report.from_gaussian("r", means[:, index], stds[:, index], y[index])
            assert float(values[row]) == pytest.approx(getattr(resampled, name), rel=1e-9, abs=1e-12), name


def test_ci_markdown_html_and_pictures(two_outputs, tmp_path) -> None:
    um, loader, _, _ = two_outputs
    report = posthoc.evaluate(um, loader, progress=False, ci=0.9, bootstraps=200, name="LLLA")
    assert report.ci == 0.9 and set(report.intervals) == set(Gaussian.COLUMNS)
    for name in ("rmse", "nll", "crps", "coverage_90"):
        low, high = report.intervals[name]
        assert low <= getattr(report, name) <= high
    markdown = report.to_markdown()
    assert markdown.splitlines()[0].startswith("| method | RMSE | MAE | NLL | CRPS | cov 50% | width 50% |")
    assert f"| LLLA | {report.rmse:.4f} [{report.intervals['rmse'][0]:.4f}, " in markdown
    html = html_page.write_html(report, tmp_path / "report.html").read_text()
    assert html.count("<img") == 2 and "<table>" in html and "MACE" in html
    curve = figures.calibration_curve(report, tmp_path / "calibration.png")
    assert (tmp_path / "calibration.png").stat().st_size > 1000
    assert len(curve.axes[0].get_lines()) == 2  # the diagonal and the method
    figures.error_against_std(report, tmp_path / "error_std.png")
    assert (tmp_path / "error_std.png").stat().st_size > 1000


def test_conformal_intervals_are_measured_on_the_test_set(two_outputs) -> None:
    um, loader, x, y = two_outputs
    generator = torch.Generator().manual_seed(8)
    xc = torch.randn(100, 3, generator=generator)
    yc = torch.stack([2 * xc[:, 0], xc[:, 1] - xc[:, 2]], 1) + 0.4 * torch.randn(100, 2, generator=generator)
    cp = posthoc.conformal(um, [(xc, yc)], alpha=0.2, progress=False)
    report = posthoc.evaluate(um, loader, conformal=cp, progress=False, ci=0.95, bootstraps=100)
    lower, upper = cp.intervals(x)
    assert report.alpha == 0.2
    assert report.coverage == pytest.approx(float(((lower <= y) & (y <= upper)).double().mean()), abs=1 / 240)
    assert report.width == pytest.approx(float((upper - lower).mean()), rel=1e-5)
    assert {"coverage", "width"} <= set(report.intervals) and report.as_dict()["alpha"] == 0.2
    assert "conformal coverage (alpha=0.2) | conformal width |" in report.to_markdown()


def test_evaluate_refuses_what_a_regressor_report_does_not_measure(two_outputs) -> None:
    um, loader, x, y = two_outputs
    with pytest.raises(ConfigError, match="ood_scores are measured against an OOD set"):
        posthoc.evaluate(um, loader, ood_scores=["variance"], progress=False)
    with pytest.raises(ConfigError, match=r"\['energy'\] read a classifier's logits"):
        posthoc.evaluate(um, loader, ood_loader=[(x, y)], ood_scores=["energy"], progress=False)
    classifier_sets = posthoc.conformal(torch.softmax(torch.randn(20, 3), -1), torch.arange(20) % 3)
    with pytest.raises(ConfigError, match="classifier's conformal sets"):
        posthoc.evaluate(um, loader, conformal=classifier_sets, progress=False)
    other = posthoc.wrap(_trained_mlp(outputs=2, seed=1)[0], method="none", likelihood="regression")
    other.fit([(x, y)], progress=False)
    with pytest.raises(ConfigError, match="calibrated on another wrapped model"):
        posthoc.evaluate(um, loader, conformal=posthoc.conformal(other, [(x, y)], progress=False), progress=False)


def test_a_test_set_smaller_than_the_ence_bins_reports_ence_as_unavailable(tmp_path) -> None:
    """ENCE needs one point per bin (10): on 5 rows it is ``None`` (``–`` in the tables) and every other metric, the
    bootstrap intervals and the HTML page are still made (was: the whole evaluation refused)."""
    net, loader, x = _trained_mlp(outputs=1)
    um = posthoc.wrap(net, method="none", likelihood="regression").fit(loader, progress=False)
    rows = [(x[:5], 2 * x[:5, :1])]
    report = posthoc.evaluate(um, rows, progress=False, ci=0.9, bootstraps=50)
    assert report.ence is None and report.as_dict()["ence"] is None and "ence" not in report.intervals
    assert report.to_markdown().splitlines()[2].endswith("| – |") and report.rmse > 0
    assert html_page.write_html(report, tmp_path / "small.html").stat().st_size > 0
    assert posthoc.evaluate(um, [(x[:10], 2 * x[:10, :1])], progress=False).ence is not None


def test_both_metric_sets_supply_every_step_of_evaluate_to_the_one_report() -> None:
    from posthoc.evaluation.report import KINDS, Categorical, report_type

    steps = ("check_options", "predict", "guarantees", "score_ood", "measured", "resampled")
    seam = ("observed", "kept", "example_nll", "example_statistics", "guarantee_columns", "values")
    assert set(KINDS.values()) == {Categorical, Gaussian}
    for kind in KINDS.values():
        assert all(callable(getattr(kind, step)) for step in (*steps, *seam))
        assert len(kind.HEADERS) == len(kind.COLUMNS)
        assert all(hasattr(Report("r"), column) for column in (*kind.COLUMNS, *kind.GUARANTEE_COLUMNS))
    regressor = posthoc.wrap(torch.nn.Linear(2, 1), method="none", likelihood="regression")
    assert report_type(regressor) is Gaussian
    assert report_type(posthoc.wrap(torch.nn.Linear(2, 3), method="none")) is Categorical
    with pytest.raises(ConfigError, match="a report's kind is one of categorical, gaussian"):
        Report("r", kind="poisson")
