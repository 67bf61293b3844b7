"""Bootstrap intervals (posthoc.evaluation.bootstrap), ``evaluate(ci=)`` and ``posthoc.compare``."""

import re

import numpy as np
import pytest
import scipy.stats
import torch
from scipy.special import ndtr

import posthoc
from posthoc.evaluation import bootstrap, metrics
from posthoc.evaluation.report import Report
from posthoc_apps.demo import data


def _classifier_outputs(n: int, generator: torch.Generator, classes: int = 4, sharpness: float = 2.0):
    """Softmax of random logits and labels drawn from those probabilities: a calibrated toy classifier."""
    probs = torch.softmax(sharpness * torch.randn(n, classes, generator=generator, dtype=torch.float64), -1)
    labels = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return probs, labels


def test_statistics_on_the_identity_index_equal_the_report_metrics():
    probs, labels = _classifier_outputs(500, torch.Generator().manual_seed(0))
    identity = torch.arange(500)[None]
    stats = bootstrap.example_statistics(probs, labels)
    expected = {
        "accuracy": metrics.accuracy,
        "nll": metrics.nll,
        "ece": metrics.ece,
        "brier": metrics.brier,
        "aurc": metrics.aurc,
        "adaptive_ece": metrics.adaptive_ece,
        "smooth_ece": metrics.smooth_ece,
        "augrc": metrics.augrc,
    }
    assert set(stats) == set(expected)
    for name, fn in expected.items():
        assert float(stats[name](identity)[0]) == pytest.approx(fn(probs, labels), abs=1e-12), name


def test_statistics_on_resamples_equal_the_metrics_of_the_resampled_examples():
    probs, labels = _classifier_outputs(200, torch.Generator().manual_seed(1))
    index = bootstrap.resample_index(200, 3, seed=4)
    stats = bootstrap.example_statistics(probs, labels)
    for row in index:
        assert float(stats["ece"](row[None])[0]) == pytest.approx(metrics.ece(probs[row], labels[row]), abs=1e-12)
        assert float(stats["brier"](row[None])[0]) == pytest.approx(metrics.brier(probs[row], labels[row]), abs=1e-12)
    # the new metrics on all resamples at once: each row its own metric (a resample has tied copies of examples;
    # the stable sorts break the ties in the same order as the metrics on the resampled examples)
    for name in ("adaptive_ece", "smooth_ece", "augrc"):
        together = stats[name](index)
        alone = [getattr(metrics, name)(probs[row], labels[row]) for row in index]
        assert together.tolist() == pytest.approx(alone, abs=1e-12), name


@pytest.mark.parametrize("method", ["percentile", "BCa"])
def test_intervals_agree_with_scipy_bootstrap(method):
    probs, labels = _classifier_outputs(400, torch.Generator().manual_seed(2))
    stats = bootstrap.example_statistics(probs, labels)
    ours = bootstrap.intervals(
        {k: stats[k] for k in ("nll", "ece")}, 400, ci=0.9, bootstraps=4000, seed=0, method=method.lower()
    )
    per_example_nll = -probs.gather(-1, labels[:, None]).squeeze(-1).log().numpy()
    theirs = scipy.stats.bootstrap(
        (per_example_nll,),
        np.mean,
        confidence_level=0.9,
        n_resamples=4000,
        method=method,
        random_state=np.random.default_rng(0),
    ).confidence_interval
    width = theirs.high - theirs.low
    assert ours["nll"][0] == pytest.approx(theirs.low, abs=0.08 * width)
    assert ours["nll"][1] == pytest.approx(theirs.high, abs=0.08 * width)

    confidence, predicted = probs.max(-1)
    correct = (predicted == labels).double()

    def ece(conf, corr, axis=-1):
        """An independent ECE in numpy over the last axis (15 bins, (lo, hi]), for any leading shape."""
        bins = np.clip(np.ceil(conf * 15).astype(int) - 1, 0, 14)
        sums = np.stack([np.where(bins == b, conf - corr, 0).sum(-1) for b in range(15)], -1)
        return np.abs(sums).sum(-1) / conf.shape[-1]

    assert ece(confidence.numpy(), correct.numpy()) == pytest.approx(metrics.ece(probs, labels), abs=1e-12)
    theirs = scipy.stats.bootstrap(
        (confidence.numpy(), correct.numpy()),
        ece,
        paired=True,
        vectorized=True,
        confidence_level=0.9,
        n_resamples=4000,
        method=method,
        random_state=np.random.default_rng(0),
    ).confidence_interval
    width = theirs.high - theirs.low
    assert ours["ece"][0] == pytest.approx(theirs.low, abs=0.15 * width)
    assert ours["ece"][1] == pytest.approx(theirs.high, abs=0.15 * width)


def test_interval_coverage_of_known_truths_over_many_draws():
    """Over 300 test sets drawn from a known model the 90% intervals hold the true accuracy, NLL and Brier
    about 90% of the time (binomial sd 1.7%: the band is about 3 sd wide on each side)."""
    generator = torch.Generator().manual_seed(3)
    logits = 2.0 * torch.randn(200_000, 4, generator=generator, dtype=torch.float64)
    population = torch.softmax(logits, -1)
    truth_labels = torch.multinomial(population, 1, generator=generator).squeeze(-1)
    truth = {
        "accuracy": metrics.accuracy(population, truth_labels),
        "nll": metrics.nll(population, truth_labels),
        "brier": metrics.brier(population, truth_labels),
    }
    hits = {name: 0 for name in truth}
    draws = 300
    for draw in range(draws):
        pick = torch.randint(200_000, (300,), generator=generator)
        stats = bootstrap.example_statistics(population[pick], truth_labels[pick])
        bounds = bootstrap.intervals({k: stats[k] for k in truth}, 300, ci=0.9, bootstraps=400, seed=draw)
        for name, (low, high) in bounds.items():
            hits[name] += low <= truth[name] <= high
    for name, count in hits.items():
        assert 0.85 <= count / draws <= 0.95, (name, count / draws)


def test_auroc_interval_covers_the_binormal_truth():
    """Scores N(0, 1) in distribution and N(1, 1) OOD: AUROC = Phi(1 / sqrt 2); 90% intervals hold it ~90% of the time."""
    rng = np.random.default_rng(0)
    truth = float(ndtr(1 / np.sqrt(2)))
    draws = 200
    hits = 0
    for draw in range(draws):
        inside, outside = torch.as_tensor(rng.normal(0, 1, 150)), torch.as_tensor(rng.normal(1, 1, 100))
        low, high = bootstrap.auroc_interval(inside, outside, ci=0.9, bootstraps=400, seed=draw)
        assert low <= metrics.ood_auroc(inside, outside) <= high
        hits += low <= truth <= high
    assert 0.83 <= hits / draws <= 0.96


def test_auroc_draws_are_the_auroc_of_each_resample_with_ties():
    generator = torch.Generator().manual_seed(7)
    inside = torch.randn(300, generator=generator).round(decimals=1)  # many ties
    outside = (torch.randn(200, generator=generator) + 1).round(decimals=1)
    draws = bootstrap.auroc_draws(inside, outside, bootstraps=5, seed=3)
    replay = torch.Generator().manual_seed(3)  # the resamples auroc_draws takes: in-distribution, then OOD
    picks_in, picks_out = torch.randint(300, (5, 300), generator=replay), torch.randint(200, (5, 200), generator=replay)
    for draw, pick_in, pick_out in zip(draws, picks_in, picks_out):
        assert float(draw) == pytest.approx(metrics.ood_auroc(inside[pick_in], outside[pick_out]), abs=1e-12)


def test_bad_levels_and_methods_are_refused():
    stats = {"m": lambda index: index.double().mean(-1)}
    for ci in (0, 1, 95):
        with pytest.raises(posthoc.ConfigError, match="confidence level"):
            bootstrap.intervals(stats, 10, ci=ci)
    with pytest.raises(posthoc.ConfigError, match="bootstraps"):
        bootstrap.intervals(stats, 10, bootstraps=1)
    with pytest.raises(posthoc.ConfigError, match="percentile"):
        bootstrap.intervals(stats, 10, method="basic")


def _report(name, probs, labels):
    return Report.from_predictions(name, probs, labels)


def test_compare_backs_a_real_difference_and_not_a_null_one():
    generator = torch.Generator().manual_seed(5)
    probs, labels = _classifier_outputs(1000, generator)
    overconfident = torch.softmax(3 * probs.log(), -1)
    good, bad = _report("calibrated", probs, labels), _report("overconfident", overconfident, labels)
    result = posthoc.compare(good, bad, metric="nll")
    assert result.difference == pytest.approx(good.nll - bad.nll)
    assert result.interval[1] < 0 and result.excludes_zero
    assert "calibrated − overconfident" in str(result)
    same = posthoc.compare(good, good, metric="ece")
    assert same.difference == 0 and same.interval == (0.0, 0.0) and not same.excludes_zero
    # on two similar models the paired interval is far narrower than either model's own interval
    similar = _report("slightly sharper", torch.softmax(1.1 * probs.log(), -1), labels)
    paired = posthoc.compare(similar, good, metric="nll").interval
    alone = bootstrap.intervals(bootstrap.example_statistics(probs, labels), 1000)["nll"]
    assert paired[1] - paired[0] < 0.5 * (alone[1] - alone[0])


def test_compare_refuses_different_examples_and_unknown_metrics():
    probs, labels = _classifier_outputs(50, torch.Generator().manual_seed(6))
    first = _report("a", probs, labels)
    with pytest.raises(posthoc.InputError, match="same test examples"):
        posthoc.compare(first, _report("b", probs, labels.roll(1)))
    with pytest.raises(posthoc.ConfigError, match="comparable metrics"):
        posthoc.compare(first, first, metric="ood_auroc")


def test_evaluate_with_ci_carries_intervals_and_shows_them(digits, digits_model):
    um = posthoc.wrap(digits_model, method="none")
    test = data.loader(data.subset(digits.test, 300), batch_size=150)
    report = posthoc.evaluate(
        um, test, data.loader(data.subset(digits.ood, 200), batch_size=200), progress=False, ci=0.95, bootstraps=300
    )
    assert report.ci == 0.95
    assert set(report.intervals) == {
        "accuracy",
        "nll",
        "ece",
        "adaptive_ece",
        "smooth_ece",
        "brier",
        "aurc",
        "augrc",
        "ood_auroc",
    }
    for name, (low, high) in report.intervals.items():
        assert low <= high
        if "ece" not in name:  # a bootstrap ECE is biased upwards: the point estimate may sit below its interval
            assert low <= getattr(report, name) <= high, name
    row = report.to_markdown().splitlines()[2]
    assert re.search(r"\| \d\.\d{4} \[\d\.\d{4}, \d\.\d{4}\] \|", row)
    assert report.as_dict()["intervals"]["nll"] == list(report.intervals["nll"])
    assert posthoc.evaluate(um, test, progress=False).intervals == {}
    with pytest.raises(posthoc.ConfigError, match="confidence level"):
        posthoc.evaluate(um, test, progress=False, ci=1.5)
