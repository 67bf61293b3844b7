"""``posthoc.selective``: the risk guarantee over many random calibration draws, the binomial bound
against scipy, the SGR search, and bad inputs.

The synthetic model is calibrated (labels drawn from its own probabilities), so the true risk of
accepting ``confidence >= t`` is ``E[1 - confidence | confidence >= t]``, known from a large pool.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import posthoc
from posthoc.evaluation.report import operating_points
from posthoc.guarantees.bounds import binomial_upper_bound
from posthoc.guarantees.selective import RiskNotReachableError, search_threshold
from posthoc_apps.demo import data
from posthoc_apps.report import figures

NUM_CLASSES = 10


pytestmark = pytest.mark.usefixtures("one_thread")


def calibrated(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities of Gaussian logits and labels drawn from those very probabilities."""
    logits = 5 * torch.randn(count, NUM_CLASSES, generator=generator, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    u = torch.rand(count, 1, generator=generator, dtype=torch.float64)
    return probs, (probs.cumsum(-1) < u).sum(-1).clamp_max(NUM_CLASSES - 1)


class TrueRisk:
    """The population risk of accepting ``confidence >= t``, from a large pool of the same model."""

    def __init__(self, generator: torch.Generator, pool: int = 400_000) -> None:
        probs, _ = calibrated(pool, generator)
        self.confidence = probs.max(-1).values.sort().values
        error = 1 - self.confidence
        self.error_from = torch.cat([error.flip(0).cumsum(0).flip(0), error.new_zeros(1)])

    def __call__(self, threshold: float) -> float:
        first = int(torch.searchsorted(self.confidence, torch.tensor(threshold, dtype=torch.float64)))
        return float(self.error_from[first]) / max(1, self.confidence.numel() - first)


def test_the_risk_guarantee_holds_over_random_calibration_draws() -> None:
    """P(true risk of the chosen threshold > target) <= delta, over 300 calibration draws."""
    generator = torch.Generator().manual_seed(0)
    true_risk = TrueRisk(generator)
    target, delta, m, draws = 0.08, 0.1, 2000, 300
    violations, naive_violations, coverages = 0, 0, []
    for _ in range(draws):
        probs, labels = calibrated(m, generator)
        sel = posthoc.selective(probs, labels, target_risk=target, delta=delta)
        violations += true_risk(sel.threshold) > target
        coverages.append(sel.coverage)
        # the naive rule (empirical risk <= target, no bound) on the same draw: the test can tell them apart
        confidence = probs.max(-1).values
        order = confidence.argsort(descending=True)
        wrong = (probs.argmax(-1) != labels)[order].double()
        ok = (wrong.cumsum(0) / torch.arange(1, m + 1)) <= target
        naive_violations += true_risk(float(confidence[order][int(ok.nonzero().max())])) > target
    slack = 2 * math.sqrt(delta * (1 - delta) / draws)
    assert violations / draws <= delta + slack, violations / draws
    assert naive_violations / draws > delta + slack, naive_violations / draws
    assert np.mean(coverages) > 0.3  # the guarantee is not bought by rejecting almost everything


def test_the_binomial_bound_against_scipy() -> None:
    """P(Binomial(n, b) <= errors) = delta at the bound, and any larger risk makes the observation less likely."""
    for n in (1, 7, 50, 1000, 20_000):
        for errors in sorted({0, 1, n // 10, n // 2, n - 1} - {n}):
            for delta in (0.001, 0.05, 0.2):
                bound = binomial_upper_bound(errors, n, delta)
                assert stats.binom.cdf(errors, n, bound) == pytest.approx(delta, rel=1e-6)
                assert stats.binom.cdf(errors, n, min(1.0, bound * (1 + 1e-4))) < delta
                assert errors / n <= bound <= 1
    assert binomial_upper_bound(5, 5, 0.05) == 1.0 and binomial_upper_bound(0, 0, 0.05) == 1.0
    assert binomial_upper_bound(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))


def test_the_search_follows_sgr() -> None:
    """ceil(log2 m) steps at level delta / ceil(log2 m); the kept threshold accepts the most among those meeting the target."""
    probs, labels = calibrated(600, torch.Generator().manual_seed(1))
    sel = posthoc.selective(probs, labels, target_risk=0.05, delta=0.05)
    steps = math.ceil(math.log2(600))
    assert len(sel.candidates) == steps
    confidence, correct = probs.max(-1).values, probs.argmax(-1) == labels
    for candidate in sel.candidates:
        accepted = confidence >= candidate.threshold
        assert candidate.accepted == int(accepted.sum()) and candidate.errors == int((~correct[accepted]).sum())
        assert candidate.bound == pytest.approx(
            binomial_upper_bound(candidate.errors, candidate.accepted, 0.05 / steps)
        )
    meeting = [c for c in sel.candidates if c.bound <= 0.05]
    assert sel.risk_bound <= 0.05 and sel.coverage == max(c.accepted for c in meeting) / 600
    assert sel.accept(probs).double().mean() == pytest.approx(sel.coverage)
    assert sel.risk == pytest.approx(1 - float(correct[sel.accept(probs)].double().mean()))
    assert search_threshold(confidence, correct, 0.05, 0.05) == sel.candidates


def test_entropy_and_epistemic_scores() -> None:
    generator = torch.Generator().manual_seed(2)
    probs, labels = calibrated(2000, generator)
    sel = posthoc.selective(probs, labels, target_risk=0.05, score="entropy")
    entropy = posthoc.Prediction.from_probs(probs).entropy
    assert torch.equal(sel.accept(probs), -entropy >= sel.threshold)
    # samples whose disagreement grows where the mean is wrong: epistemic deferral works
    noise = torch.randn(8, 2000, NUM_CLASSES, generator=generator, dtype=torch.float64)
    spread = (1 - probs.max(-1).values)[None, :, None]
    samples = torch.softmax(probs.log()[None] + 3 * spread * noise, -1)
    pred = posthoc.Prediction.from_probs(samples.mean(0), samples)
    epistemic = posthoc.selective(pred, labels, target_risk=0.1, score="epistemic")
    assert torch.equal(epistemic.accept(pred), -pred.epistemic >= epistemic.threshold)
    with pytest.raises(posthoc.ConfigError, match="not arrays of probabilities"):
        epistemic.accept(pred.probs)
    with pytest.raises(posthoc.ConfigError, match="needs samples from a sampling predictive"):
        posthoc.selective(probs, labels, score="epistemic")
    with pytest.raises(posthoc.ConfigError, match="the predictive is deterministic"):
        posthoc.selective(posthoc.Prediction.from_probs(probs), labels, score="epistemic")


def test_a_wrapped_model(digits: data.DigitsSplits, digits_model: torch.nn.Module, tmp_path) -> None:
    um = posthoc.wrap(digits_model, method="none").fit()
    sel = posthoc.selective(um, data.loader(digits.calibration, 200), target_risk=0.02, progress=False)
    x, y = digits.test.tensors
    assert torch.equal(sel.accept(x), sel.accept(um.predict(x)))
    report = posthoc.evaluate(um, data.loader(digits.test, 500), selective=sel, progress=False)
    assert report.target_risk == 0.02 and 0 < report.deferral < 0.5 and report.selective_risk < 0.02
    assert "deferral (target risk=0.02) | accepted error |" in report.to_markdown()
    assert operating_points(report) == {"none": (1 - report.deferral, report.selective_risk)}
    figures.risk_coverage_curve(report, tmp_path / "risk_coverage.png")  # with the operating point and the target
    assert (tmp_path / "risk_coverage.png").stat().st_size > 1000
    with pytest.raises(posthoc.ConfigError, match="calibrated on another wrapped model"):
        posthoc.evaluate(posthoc.wrap(digits_model, method="none").fit(), data.loader(digits.test), selective=sel)


def test_an_unreachable_target_says_what_would_help() -> None:
    probs, labels = calibrated(200, torch.Generator().manual_seed(3))
    with pytest.raises(
        RiskNotReachableError, match=r"no confidence threshold meets target_risk=0.001 .* about \d+ examples"
    ):
        posthoc.selective(probs, labels, target_risk=0.001)
    assert issubclass(RiskNotReachableError, posthoc.ConfigError)


def test_bad_inputs_have_clear_errors() -> None:
    probs, labels = calibrated(100, torch.Generator().manual_seed(4))
    cases = [
        (dict(target_risk=0), "target_risk must be a number strictly between 0 and 1"),
        (dict(target_risk=1.2), "target_risk must be"),
        (dict(delta=1), "delta must be a number strictly between 0 and 1"),
        (dict(score="margin"), "unknown selection score 'margin'"),
    ]
    for options, message in cases:
        with pytest.raises(posthoc.ConfigError, match=message):
            posthoc.selective(probs, labels, **options)
    with pytest.raises(posthoc.InputError, match="100 calibration examples but 99 labels"):
        posthoc.selective(probs, labels[:99])
