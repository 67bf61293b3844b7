import warnings

import numpy as np
import pytest
import torch

import posthoc
from posthoc.evaluation import metrics
from posthoc.core.errors import InputError
from posthoc.methods.calibration.temperature import MAX_TEMPERATURE, fit_temperature, tempered_log_probs


def _overconfident_logits(n=3000, c=6, true_t=2.5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    true_logits = torch.randn(n, c, generator=generator) * 2
    labels = torch.distributions.Categorical(logits=true_logits).sample()
    return true_logits * true_t, labels


def test_recovers_the_temperature_that_generated_the_labels():
    logits, labels = _overconfident_logits(true_t=2.5)
    calibrator = posthoc.calibrate(logits, labels)
    assert calibrator.temperature == pytest.approx(2.5, rel=0.08)
    assert metrics.nll(calibrator(logits), labels) < metrics.nll(logits.softmax(-1), labels)


def test_fitted_temperature_is_the_nll_minimum():
    logits, labels = _overconfident_logits(seed=3)
    t = posthoc.calibrate(logits, labels).temperature
    nll = lambda temp: float(torch.nn.functional.cross_entropy(logits / temp, labels))
    assert nll(t) <= min(nll(t * 0.97), nll(t * 1.03))


def test_matches_netcal_on_the_same_logits():
    netcal = pytest.importorskip("netcal.scaling")
    logits, labels = _overconfident_logits(n=2000, true_t=1.8, seed=1)
    ours = posthoc.calibrate(logits, labels)
    scaler = netcal.TemperatureScaling(detection=False, use_cuda=False)
    scaler.fit(logits.softmax(-1).double().numpy(), labels.numpy())
    theirs = np.asarray(scaler.transform(logits.softmax(-1).double().numpy()))
    ours_probs = ours(logits).double().numpy()
    their_nll = metrics.nll(torch.as_tensor(theirs), labels)
    our_nll = metrics.nll(torch.as_tensor(ours_probs), labels)
    assert our_nll <= their_nll + 1e-4
    assert np.abs(ours_probs - theirs).max() < 0.02


def test_binary_logits_and_numpy_inputs():
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(2000, generator=generator) * 2
    labels = torch.bernoulli(torch.sigmoid(z), generator=generator).long()
    calibrator = posthoc.calibrate((z * 3).numpy(), labels.numpy())
    assert calibrator.temperature == pytest.approx(3.0, rel=0.15)
    assert calibrator(z.numpy()).shape == (2000, 2)


def test_temperature_is_bounded_and_warns_on_separable_data():
    logits = torch.tensor([[5.0, -5.0], [-5.0, 5.0]] * 50)
    labels = torch.tensor([0, 1] * 50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = fit_temperature(torch.log_softmax(logits, -1), labels)
    assert 0 < t and np.isfinite(t)
    assert t >= 1e-2
    assert any("bound" in str(w.message) for w in caught) or t < MAX_TEMPERATURE


def test_bad_logits_and_labels():
    logits, labels = _overconfident_logits(n=10)
    with pytest.raises(InputError, match="different lengths"):
        posthoc.calibrate(logits, labels[:5])
    bad = logits.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(InputError, match="NaN or inf logits"):
        posthoc.calibrate(bad, labels)
    with pytest.raises(InputError, match=r"labels must lie in \[0, 6\)"):
        posthoc.calibrate(logits, labels + 6)
    with pytest.raises(InputError, match="regression targets"):
        posthoc.calibrate(logits, labels.float() + 0.5)
    with pytest.raises(posthoc.ConfigError, match="valid: .*temperature"):
        posthoc.calibrate(logits, labels, method="plat")
    with pytest.raises(posthoc.ConfigError, match="'platt' calibrates binary classifiers"):
        posthoc.calibrate(logits, labels, method="platt")
    for max_iter in (0, 2.5, True):
        with pytest.raises(posthoc.ConfigError, match=f"max_iter must be a positive integer, got {max_iter!r}"):
            posthoc.calibrate(logits, labels, max_iter=max_iter)


def test_wrapped_temperature_runs_the_model_once_over_val(digits_model, loaders):
    calls = []
    hook = digits_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        um = posthoc.wrap(digits_model, method="temperature").fit(val_loader=loaders["calibration"], progress=False)
    finally:
        hook.remove()
    assert len(calls) == len(loaders["calibration"])
    assert 0.01 < float(um.method.temperature) < 100


def test_wrapped_temperature_equals_calibrate_on_logits(digits_model, digits, loaders):
    um = posthoc.wrap(digits_model, method="temperature").fit(val_loader=loaders["calibration"], progress=False)
    x, y = digits.calibration.tensors
    with torch.no_grad():
        logits = digits_model(x)
    assert float(um.method.temperature) == pytest.approx(posthoc.calibrate(logits, y).temperature, rel=1e-4)


def test_on_top_of_samples_tempers_each_sample():
    samples = torch.log_softmax(torch.randn(4, 3, 5), -1)
    mixed = tempered_log_probs(samples, 2.0)
    expected = torch.log_softmax(samples / 2.0, -1).exp().mean(0).log()
    assert torch.allclose(mixed, expected, atol=1e-6)
