"""Learn then Test (``posthoc.risk_control(..., method="ltt")``): several risks controlled at once over 300
calibration draws, against MAPIE's Learn-then-Test (``BinaryClassificationController`` with two risks, and its
``ltt_procedure`` for losses that are fractions), and its errors.

The population: 100,000 synthetic multi-label examples, 6 labels each (a label is positive w.p. 0.25), sigmoid scores
of noisy logits. Each draw calibrates on 1,000 of them; the true risks of the threshold kept are the population's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mapie.risk_control import BinaryClassificationController, BinaryRisk, predicted_positive_fraction
from mapie.risk_control._base_controller import ltt_procedure
from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value

import posthoc
from posthoc.guarantees import RiskNotReachableError
from posthoc.guarantees.learn_then_test import DEFAULT_THRESHOLDS, example_losses, fwer_rejections, hoeffding_bentkus

pytestmark = pytest.mark.usefixtures("one_thread")

POPULATION = 100_000


def population(count: int, labels: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    targets = torch.rand(count, labels, generator=generator) < 0.25
    noise = 1.5 * torch.randn(count, labels, generator=generator, dtype=torch.float64)
    return torch.sigmoid(1.5 * (2 * targets.double() - 1) + noise), targets.long()


def test_every_risk_holds_with_probability_one_minus_delta_over_300_draws() -> None:
    probs, targets = population(POPULATION, 6, seed=0)
    grid = torch.tensor(DEFAULT_THRESHOLDS, dtype=torch.float64)
    masks, truth, valid = probs[None] >= grid[:, None, None], targets.bool(), torch.ones_like(targets, dtype=torch.bool)
    true_fnr = example_losses("fnr", masks, truth, valid).mean(1)  # (T,): the population's risks
    true_size = example_losses("size", masks, truth, valid).mean(1)
    alphas, delta, draws = (0.2, 0.4), 0.1, 300
    generator = torch.Generator().manual_seed(1)
    failures, plug_in_failures, kept = 0, 0, []
    for _ in range(draws):
        cal = torch.randint(POPULATION, (1000,), generator=generator)  # i.i.d. draws from the population
        rc = posthoc.risk_control(
            probs[cal], targets[cal], alpha=alphas, loss=["fnr", "size"], method="ltt", delta=delta
        )
        k = DEFAULT_THRESHOLDS.index(rc.threshold)
        failures += bool(true_fnr[k] > alphas[0] or true_size[k] > alphas[1])
        kept.append(rc.threshold)
        # the plug-in choice (calibration risks under the levels, the smallest FNR) fails about a sixth of the time
        cal_fnr, cal_size = rc.empirical
        ok = np.flatnonzero((cal_fnr <= alphas[0]) & (cal_size <= alphas[1]))
        naive = ok[np.argmin(cal_fnr[ok])]
        plug_in_failures += bool(true_fnr[naive] > alphas[0] or true_size[naive] > alphas[1])
    assert failures / draws <= delta, failures  # Learn then Test: at most delta (it is conservative: about 0)
    assert plug_in_failures / draws > 0.12, plug_in_failures  # the test can tell a method without the guarantee
    assert 0.4 < np.median(kept) < 0.6  # inside the feasible band: size <= 0.4 from t ~ 0.37, FNR <= 0.2 to t ~ 0.65


def test_two_binary_risks_equal_mapies_controller() -> None:
    """One label per example: the FNR loss is 'positive and missed', the size 'predicted positive' (MAPIE's
    ``predicted_positive_fraction``); both 0 or 1, so both use the binary Bentkus bound. Same valid thresholds, same
    p-values, same threshold kept (the smallest first risk)."""
    probs, targets = population(2000, 1, seed=2)
    missed = BinaryRisk(
        risk_occurrence=lambda y_true, y_pred: (y_true == 1) & (y_pred == 0),
        risk_condition=lambda y_true, y_pred: np.repeat(True, len(y_true)),
        higher_is_better=False,
    )
    scores = probs.numpy()
    for alphas, delta in (((0.08, 0.45), 0.1), ((0.1, 0.4), 0.05), ((0.06, 0.5), 0.2)):
        reference = BinaryClassificationController(
            predict_function=lambda x: np.c_[1 - x, x],
            risk=[missed, predicted_positive_fraction],
            target_level=list(alphas),
            confidence_level=1 - delta,
            list_predict_params=np.asarray(DEFAULT_THRESHOLDS),
        ).calibrate(scores[:, 0], targets[:, 0].numpy())
        rc = posthoc.risk_control(probs, targets, alpha=alphas, loss=["fnr", "size"], method="ltt", delta=delta)
        assert np.array_equal(rc.valid, reference.valid_predict_params), alphas
        assert rc.threshold == reference.best_predict_param and len(rc.valid) > 3
        np.testing.assert_allclose(rc.p_values, reference.p_values.ravel(), rtol=1e-10, atol=1e-300)


def test_fractional_losses_equal_mapies_ltt_procedure() -> None:
    probs, targets = population(800, 6, seed=3)
    alphas, delta = (0.25, 0.4, 0.35), 0.1
    rc = posthoc.risk_control(
        probs, targets, alpha=alphas, loss=["fnr", "fdr", "size"], method="ltt", delta=delta, fwer="bonferroni"
    )
    for j, alpha in enumerate(alphas):
        reference = compute_hoeffding_bentkus_p_value(rc.empirical[j], 800, alpha, binary=False)[:, 0]
        np.testing.assert_allclose(hoeffding_bentkus(rc.empirical[j], 800, alpha, False), reference, rtol=1e-12)
    for method in ("bonferroni", "bonferroni_holm"):
        valid, p_values = ltt_procedure(
            rc.empirical, np.array(alphas)[:, None], delta, np.full(rc.empirical.shape, 800), fwer_method=method
        )
        ours = posthoc.risk_control(
            probs, targets, alpha=alphas, loss=["fnr", "fdr", "size"], method="ltt", delta=delta, fwer=method
        )
        assert np.array_equal(ours.valid, np.asarray(DEFAULT_THRESHOLDS)[valid[0]]) and len(valid[0]) > 3
        np.testing.assert_allclose(ours.p_values, p_values[:, 0], rtol=1e-12)
    assert np.array_equal(fwer_rejections(np.array([0.2, 0.01, 0.02]), 0.06, "bonferroni_holm"), [1, 2])


def test_ltt_options_and_errors() -> None:
    probs, targets = population(300, 6, seed=4)
    rc = posthoc.risk_control(probs, targets, alpha=[0.3, 0.5], loss=["fnr", "size"], method="ltt", objective="size")
    assert rc.risks["size"] == min(rc.empirical[1][np.isin(np.asarray(DEFAULT_THRESHOLDS), rc.valid)])
    assert rc.mask(probs).shape == probs.shape and "MultiRiskController(fnr<=0.3, size<=0.5" in repr(rc)
    cases = [
        (dict(alpha=[0.1], loss=["fnr", "size"]), posthoc.ConfigError, "one level per loss"),
        (dict(alpha=[0.1, 0.2], loss=["fnr", "iou"]), posthoc.ConfigError, "unknown Learn-then-Test loss"),
        (dict(alpha=[0.1, 0.2], loss=["fnr", "fnr"]), posthoc.ConfigError, "each loss once"),
        (dict(alpha=0.1, loss="fnr", fwer="holm"), posthoc.ConfigError, "fwer must be one of"),
        (dict(alpha=0.1, loss="fnr", delta=1.5), posthoc.ConfigError, "delta"),
        (dict(alpha=0.1, loss="fnr", thresholds=[]), posthoc.ConfigError, "thresholds must be"),
        (dict(alpha=[0.01, 0.01], loss=["fnr", "size"]), RiskNotReachableError, "no threshold of the grid controls"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            posthoc.risk_control(probs, targets, method="ltt", **options)
    with pytest.raises(posthoc.ConfigError, match="unknown risk-control method"):
        posthoc.risk_control(probs, targets, method="lt")
