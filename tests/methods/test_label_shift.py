"""``posthoc.label_shift``: prior estimates (BBSE, EM) and the corrected predictive on synthetic label shifts.

The model is the exact Bayes classifier of four Gaussian classes (shared covariance) under uniform training priors,
so it is calibrated on the training distribution and everything the correction gains comes from the priors.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc.methods.label_shift.estimate import bbse_priors, em_priors

CLASSES, FEATURES = 4, 2
MEANS = 1.6 * torch.stack(
    [torch.cos(torch.arange(CLASSES) * math.pi / 2), torch.sin(torch.arange(CLASSES) * 0.5 * math.pi)], 1
)
STRENGTHS = (0.5, 1.0, 2.0)


def _bayes_model() -> nn.Module:
    """``log N(x | mu_c, I) + log(1/C)`` up to a constant: a linear layer."""
    model = nn.Linear(FEATURES, CLASSES)
    with torch.no_grad():
        model.weight.copy_(MEANS)
        model.bias.copy_(-0.5 * MEANS.square().sum(-1))
    return model.eval()


def _priors(strength: float) -> torch.Tensor:
    """Deployment priors ``softmax(-strength * c)``: one class ever more common as ``strength`` grows."""
    return torch.softmax(-strength * torch.arange(CLASSES, dtype=torch.float64), 0)


def _draw(count: int, priors: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.multinomial(priors.float(), count, replacement=True, generator=generator)
    return MEANS[labels] + torch.randn(count, FEATURES, generator=generator), labels


def _loader(x: torch.Tensor, y: torch.Tensor | None = None) -> DataLoader:
    return DataLoader(TensorDataset(x) if y is None else TensorDataset(x, y), batch_size=1000)


def _unlabelled(x: torch.Tensor) -> DataLoader:
    return DataLoader(x, batch_size=1000)


UNIFORM = torch.full((CLASSES,), 1 / CLASSES, dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["em", "bbse"])
def test_prior_error_shrinks_with_the_target_size(estimator: str) -> None:
    """Mean L1 error of q over 4 draws, at 200, 2,000 and 20,000 deployment examples: it falls each time, to under
    half of the first (what is left is the error of the 2,000 held-out examples: BBSE's confusion matrix, EM's
    calibration)."""
    model, truth = _bayes_model(), _priors(1.0)
    errors = []
    for size in (200, 2000, 20000):
        total = 0.0
        for seed in range(4):
            generator = torch.Generator().manual_seed(seed)
            x_val, y_val = _draw(2000, UNIFORM, generator)
            x_target, _ = _draw(size, truth, generator)
            with torch.no_grad():
                shifted = posthoc.label_shift(
                    logits=model(x_val),
                    labels=y_val,
                    target_logits=model(x_target),
                    estimator=estimator,
                    progress=False,
                )
            total += float((torch.tensor(shifted.method.target) - truth).abs().sum())
        errors.append(total / 4)
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.5 * errors[0] and errors[2] < 0.06, errors


@pytest.mark.parametrize("strength", STRENGTHS)
def test_nll_and_accuracy_improve_on_the_shifted_test_set(strength: float) -> None:
    """On a shifted test set of 4,000, both estimators lower the NLL and raise the accuracy of the calibrated model
    (the weakest shift: accuracy not lower)."""
    generator = torch.Generator().manual_seed(int(10 * strength))
    truth = _priors(strength)
    x_val, y_val = _draw(2000, UNIFORM, generator)
    x_target, _ = _draw(3000, truth, generator)
    x_test, y_test = _draw(4000, truth, generator)
    um = posthoc.wrap(_bayes_model(), method="none")
    plain = posthoc.evaluate(um, _loader(x_test, y_test), progress=False)
    for estimator in ("em", "bbse"):
        shifted = posthoc.label_shift(
            um, _loader(x_val, y_val), _unlabelled(x_target), estimator=estimator, progress=False
        )
        report = posthoc.evaluate(shifted, _loader(x_test, y_test), progress=False)
        assert report.nll < plain.nll - 0.01 * strength, (estimator, report.nll, plain.nll)
        if strength >= 1:
            assert report.accuracy > plain.accuracy + 0.005, (estimator, report.accuracy, plain.accuracy)
        else:
            assert report.accuracy >= plain.accuracy - 0.002, (estimator, report.accuracy, plain.accuracy)


def test_em_and_bbse_recover_known_priors_exactly_on_the_population() -> None:
    """With the population's own posteriors (the model is exact), EM's fixed point and BBSE's solution are q."""
    generator = torch.Generator().manual_seed(0)
    truth = _priors(1.5)
    x_val, y_val = _draw(40000, UNIFORM, generator)
    x_target, _ = _draw(40000, truth, generator)
    model = _bayes_model()
    with torch.no_grad():
        val, target = model(x_val).log_softmax(-1), model(x_target).log_softmax(-1)
    assert (em_priors(target, UNIFORM) - truth).abs().max() < 0.015
    assert (bbse_priors(val, y_val, target) - truth).abs().max() < 0.015


def test_saves_loads_exports_and_stacks(tmp_path) -> None:
    generator = torch.Generator().manual_seed(1)
    truth = _priors(1.0)
    x_val, y_val = _draw(1000, UNIFORM, generator)
    x_target, _ = _draw(1000, truth, generator)
    model = _bayes_model()
    um = posthoc.wrap(model, method="none")
    shifted = posthoc.label_shift(um, _loader(x_val, y_val), _unlabelled(x_target), progress=False)
    assert shifted.methods == ["none", "label-shift"]
    probs = shifted.predict(x_target[:50]).probs
    shifted.save(str(tmp_path / "shifted.pt"))
    loaded = posthoc.load(str(tmp_path / "shifted.pt"), model)
    assert torch.allclose(loaded.predict(x_target[:50]).probs, probs, atol=1e-6)
    assert torch.allclose(shifted.to_module()(x_target[:50]), probs, atol=1e-5)
    # the same correction by hand: the calibrated predictive times q / p
    method = shifted.method
    calibrated = torch.log_softmax(
        um.predict(x_target[:50]).probs.double().log() / method.temperature + method.bias, -1
    )
    by_hand = torch.softmax(calibrated + method.log_weights, -1)
    assert torch.allclose(probs.double(), by_hand, atol=1e-5)
    # given priors, through wrap: the same stage, fitted on the held-out data
    given = posthoc.wrap(model, method="label-shift", target_priors=method.target)
    given.fit(None, _loader(x_val, y_val), progress=False)
    assert torch.allclose(given.predict(x_target[:50]).probs, probs, atol=1e-4)


def test_a_sampling_inner_method_is_corrected_per_sample() -> None:
    generator = torch.Generator().manual_seed(2)
    x_val, y_val = _draw(600, UNIFORM, generator)
    x_target, _ = _draw(600, _priors(1.0), generator)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, CLASSES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = posthoc.wrap(model, method="mc-dropout", p=0.3, num_samples=4).fit(
            None, _loader(x_val, y_val), progress=False
        )
    shifted = posthoc.label_shift(um, _loader(x_val, y_val), _unlabelled(x_target), progress=False)
    prediction = shifted.predict(x_target[:20], generator=torch.Generator().manual_seed(0))
    assert prediction.samples is not None and prediction.samples.shape == (4, 20, CLASSES)
    assert torch.allclose(prediction.samples.mean(0), prediction.probs, atol=1e-5)


def test_clear_errors() -> None:
    generator = torch.Generator().manual_seed(3)
    x_val, y_val = _draw(400, UNIFORM, generator)
    x_target, y_target = _draw(400, _priors(1.0), generator)
    um = posthoc.wrap(_bayes_model(), method="none")
    val = _loader(x_val, y_val)
    one_hot = nn.functional.one_hot(y_target, CLASSES).float()
    with pytest.raises(InputError, match="target_loader's labels have shape"):
        posthoc.label_shift(um, val, _loader(x_target, one_hot), progress=False)
    with pytest.raises(InputError, match="target_loader"):
        posthoc.label_shift(um, val, _loader(x_target, y_target + CLASSES), progress=False)
    never_three = _bayes_model()
    with torch.no_grad():
        never_three.bias[3] = -1e3
    with pytest.raises(InputError, match=r"never predicted.*estimator='em'"):
        posthoc.label_shift(
            posthoc.wrap(never_three, method="none"), val, _unlabelled(x_target), estimator="bbse", progress=False
        )
    with pytest.raises(InputError, match=r"no example of class\(es\) \[3\]"):
        keep = y_val != 3
        posthoc.label_shift(um, _loader(x_val[keep], y_val[keep]), _unlabelled(x_target), progress=False)
    with pytest.raises(ConfigError, match="estimator"):
        posthoc.label_shift(um, val, _unlabelled(x_target), estimator="kmm")
    with pytest.raises(ConfigError, match="target_priors"):
        posthoc.wrap(_bayes_model(), method="label-shift").fit(None, val, progress=False)
    with pytest.raises(ConfigError, match="sum to 1"):
        posthoc.wrap(_bayes_model(), method="label-shift", target_priors=[0.5, 0.5, 0.5, 0.5])
    with pytest.raises(InputError, match="not both"):
        posthoc.label_shift(um, val, logits=torch.zeros(3, 4))
