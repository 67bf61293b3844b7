"""The tools a regressor had missed: ``dac`` as a variance inflation, shift-aware selection graded by RMSE, OOD scores.

The checkpoint is the seed 004 sinusoid's MLP (:mod:`posthoc_apps.demo.data`, hidden width 16, about a second to
train): 40 training points in two clusters, a gap between them and nothing beyond ``x = 1``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sklearn.covariance import EmpiricalCovariance
from sklearn.metrics import roc_auc_score
from sklearn.neighbors import NearestNeighbors
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Gaussian
from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.feature_bank import normalised
from posthoc.engine.held_out import HeldOut
from posthoc.engine.perturb import feature_noise
from posthoc.errors import ConfigError
from posthoc.methods.dac.variance import Spread, inflated
from posthoc.ood import available_scores
from posthoc_apps.demo.data import _sinusoid_targets, sinusoid, train_mlp

#: inputs far outside the sinusoid's range (its inputs are centred: the data lie in [-2, 2])
FAR = torch.cat([torch.linspace(3, 6, 40), -torch.linspace(3, 6, 40)])[:, None]


@pytest.fixture(scope="module")
def problem() -> dict:
    data = sinusoid(4)
    net = train_mlp(data.train, hidden=16, epochs=300, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 40 points leave Laplace's curvature singular: it says so
        plain = posthoc.wrap(net, method="none", likelihood="regression").fit(
            data.train_loader(), data.val_loader(), progress=False
        )
        dac = posthoc.wrap(net, method=["none", "dac"], likelihood="regression").fit(
            data.train_loader(), data.val_loader(), progress=False
        )
    return {"data": data, "net": net, "plain": plain, "dac": dac}


def _gap_pairs(data) -> tuple[torch.Tensor, torch.Tensor]:
    """The gap's inputs with targets drawn from the sinusoid's own noise (the inputs are centred: x = 4 (u - 0.5))."""
    x = data.regions["gap"]
    return x, _sinusoid_targets(x[:, 0] / 4 + 0.5, torch.Generator().manual_seed(1))[:, None]


# ------------------------------------------------------------------------------ dac as a variance inflation
def test_the_inflated_mixture_is_exact_and_the_cached_nll_is_its_log_density() -> None:
    generator = torch.Generator().manual_seed(0)
    means, model, noise = (torch.randn(3, 5, 2, generator=generator, dtype=torch.float64) for _ in range(3))
    pred = RegressionPrediction.from_components(means, model.square(), noise.square() + 0.1)
    factor = 1 + torch.rand(5, generator=generator, dtype=torch.float64) * 3
    wider = inflated(pred, factor)
    torch.testing.assert_close(wider.mean, pred.mean, rtol=0, atol=1e-12)
    for part in ("variance", "aleatoric", "epistemic"):
        torch.testing.assert_close(getattr(wider, part), factor[:, None] * getattr(pred, part), rtol=1e-12, atol=1e-12)
    targets = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    spread = Spread(pred.component_means, pred.model_variances + pred.noise, torch.zeros(5, 1), targets)
    torch.testing.assert_close(spread.nlls(factor), -wider.log_prob(targets), rtol=1e-10, atol=1e-10)


def test_dac_widens_a_regressor_far_from_the_training_inputs_and_keeps_it_near_them(problem) -> None:
    """Every example nearer to the training features than the anchor quantile of the clean held-out ones keeps the
    inner predictive exactly (factor 1), so most training inputs are unchanged: the median ratio is 1 and the mean
    ratio within 5 %. In the gap between the clusters the features lie far from the training ones and the std widens
    (by 1.13x here, at the variance factor the selection admits on 40 held-out points). Beyond x = 1 this narrow
    network's unit-normalised tanh features saturate towards those of the last training points, so DAC cannot see
    it there (the 64-wide network of ``benchmarks/bench_regression.py`` can: 1.7x)."""
    plain, dac, data = problem["plain"], problem["dac"], problem["data"]
    ratio = {name: dac.predict(x).std / plain.predict(x).std for name, x in data.regions.items()}
    assert ratio["train"].median() == pytest.approx(1.0, abs=1e-6) and ratio["train"].mean() <= 1.05
    assert ratio["gap"].mean() > 1.05, {k: float(v.mean()) for k, v in ratio.items()}
    assert bool((dac.predict(FAR).std >= plain.predict(FAR).std * (1 - 1e-6)).all())  # the factor never shrinks
    card = dac.summary()["posterior"][1]
    assert card["variance_scale"] > 0 and card["shift"]["graded_by"] == "rmse" and len(card["weights"]) == 2


def test_dac_on_a_regressor_costs_at_most_the_tolerance_on_new_data_and_helps_in_the_gap(problem) -> None:
    """The selection admits a candidate only if its clean excess over the plain model is confidently within the
    tolerance: on the test points (new data from the same clusters) the excess stays within it."""
    plain, dac, data = problem["plain"], problem["dac"], problem["data"]
    selection = dac.summary()["selection"]
    x, y = data.test
    excess = float(-dac.predict(x).log_prob(y).mean() + plain.predict(x).log_prob(y).mean())
    assert excess <= selection["tolerance"], (excess, selection["chosen"])
    gap_x, gap_y = _gap_pairs(data)
    assert float(-dac.predict(gap_x).log_prob(gap_y).mean()) < float(-plain.predict(gap_x).log_prob(gap_y).mean())


@pytest.mark.parametrize("inner", ["laplace", "mc-dropout", "ensemble"])  # mc-dropout at a fixed rate: a fast fit
def test_dac_stacks_on_any_regression_method_and_saves_and_loads(problem, inner, tmp_path) -> None:
    data, net = problem["data"], problem["net"]
    model = [net, train_mlp(data.train, hidden=16, epochs=300, seed=1)] if inner == "ensemble" else net
    chain = ["none", "dac"] if inner == "ensemble" else [inner, "dac"]
    options = {"p": 0.1, "num_samples": 10} if inner == "mc-dropout" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        um = posthoc.wrap(model, method=chain, likelihood="regression", **options).fit(
            data.train_loader(), data.val_loader(), progress=False
        )
    x = torch.cat([data.regions["train"], FAR])
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        inner_pred = um.method.inner.regression_predictive(x, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pred.mean, inner_pred.mean, rtol=1e-5, atol=1e-6)
    assert bool((pred.variance >= inner_pred.variance * (1 - 1e-5)).all())
    um.save(tmp_path / "dac.pt")
    loaded = posthoc.load(tmp_path / "dac.pt", model)
    again = loaded.predict(x, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.variance, pred.variance) and torch.equal(again.mean, pred.mean)
    assert loaded.summary()["posterior"][-1]["weights"] == um.summary()["posterior"][-1]["weights"]


# ------------------------------------------------------------------------------ shift-aware selection by RMSE
def test_shift_aware_selection_of_a_regressor_grades_feature_noise_by_the_rise_in_rmse(problem) -> None:
    """The perturbed copies are graded on the plain model: level k where its RMSE has risen STRENGTHS[k] of the way
    to a constant prediction's; every held-out choice then scores them by their Gaussian NLL (DAC's, a knob's)."""
    data, net = problem["data"], problem["net"]
    selection = problem["dac"].summary()["selection"]
    assert selection["shift"]["graded_by"] == "rmse" and list(selection["shift"]["kinds"]) == ["feature-noise"]
    assert (
        selection["perturbed"] == 3 * len(data.val[1])
        and selection["plain"]["shifted_nll"] > selection["plain"]["clean_nll"]
    )
    assert all(record["shifted_nll"] is not None for record in selection["candidates"])
    x, y = data.val  # the grading rows: every validation point (fewer than 256)
    rmse = lambda inputs: float((net(inputs) - y).square().mean().sqrt())  # noqa: E731
    with torch.no_grad():
        levels = [
            rmse(feature_noise(x, strength, torch.Generator().manual_seed(0)))
            for strength in selection["shift"]["kinds"]["feature-noise"]
        ]
        clean, constant = rmse(x), float(y.std(unbiased=False))
    assert clean < levels[0] < levels[1] < levels[2] < constant, (clean, levels, constant)
    held = HeldOut.read(data.val_loader(), model=net, likelihood=Gaussian(), device="cpu")
    knob = held.regression_scores(
        lambda inputs, generator: net(inputs).detach()[None]
    )  # a knob's scores: the plain spread
    torch.testing.assert_close(knob.shifted, held.plain.shifted, rtol=1e-12, atol=1e-12)
    assert knob.shifted.shape == (3 * len(y),) and float(knob.shifted.mean()) == pytest.approx(
        selection["plain"]["shifted_nll"], abs=1e-6
    )


# ------------------------------------------------------------------------------ OOD scores
def test_knn_mahalanobis_and_the_predictive_variance_tell_far_inputs_from_test_inputs(problem) -> None:
    data, dac = problem["data"], problem["dac"]
    det = posthoc.detector(dac, score=["knn", "mahalanobis", "variance"], k=5).fit(data.train_loader(), progress=False)
    x = data.test[0]
    near, far = det.scores(x), det.scores(FAR)
    labels = [0] * len(x) + [1] * len(FAR)
    for name in ("knn", "mahalanobis", "variance"):
        assert roc_auc_score(labels, torch.cat([near[name], far[name]]).numpy()) > 0.9, name
    report = posthoc.evaluate(
        dac,
        data.test_loader(),
        DataLoader(TensorDataset(FAR, torch.zeros(len(FAR), 1)), 64),
        ood_scores=det,
        progress=False,
    )
    expected = roc_auc_score(
        labels, torch.cat([dac.predict(x).variance[:, 0], dac.predict(FAR).variance[:, 0]]).numpy()
    )
    assert report.ood_auroc == pytest.approx(expected, abs=1e-12) and set(report.ood) == {
        "variance",
        "knn",
        "mahalanobis",
    }
    assert "| knn |" in report.ood_to_markdown()


def test_the_regressor_scores_agree_with_scikit_learn(problem) -> None:
    """knn is the distance to the k-th nearest unit-normalised training feature (the head's input: the last Linear's),
    mahalanobis the squared distance to the training features' mean under their (biased) covariance."""
    data, net = problem["data"], problem["net"]
    det = posthoc.detector(net, score="knn", k=5, likelihood="regression").fit(data.train_loader(), progress=False)
    queries = torch.cat([data.test[0], FAR])
    with torch.no_grad():
        bank, features = net[:-1](data.train[0]).double(), net[:-1](queries).double()
    scores = det.scores(queries)
    distances, _ = (
        NearestNeighbors(n_neighbors=5)
        .fit(normalised(bank).double().numpy())
        .kneighbors(normalised(features).double().numpy())
    )
    torch.testing.assert_close(scores["knn"].double(), torch.from_numpy(distances[:, -1]), rtol=0, atol=1e-6)

    # mahalanobis on a regressor whose features have a well-conditioned covariance (the sinusoid's 16 tanh features of
    # a one-dimensional input span a few directions only, so two pseudo-inverses disagree about the rest)
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    x = torch.randn(300, 5, generator=torch.Generator().manual_seed(0))
    det = posthoc.detector(wide, score="mahalanobis", likelihood="regression").fit(
        [(x[:200], x[:200, :1])], progress=False
    )
    with torch.no_grad():
        bank, features = wide[:-1](x[:200]).double(), wide[:-1](torch.cat([x[200:], 3 * x[200:]])).double()
    squared = torch.from_numpy(EmpiricalCovariance().fit(bank.numpy()).mahalanobis(features.numpy()))
    torch.testing.assert_close(det.score(torch.cat([x[200:], 3 * x[200:]])).double(), squared, rtol=1e-5, atol=1e-6)


def test_classifier_scores_are_refused_for_a_regressor_naming_those_that_work(problem) -> None:
    dac, net = problem["dac"], problem["net"]
    for score in ("energy", "msp", "max-logit", "entropy", "vim"):
        with pytest.raises(ConfigError, match=r"read a classifier's logits .* Its scores: mahalanobis, knn, variance"):
            posthoc.detector(dac, score=score)
    with pytest.raises(ConfigError, match="'variance' score reads a regressor's predictive variance: pass a wrapped"):
        posthoc.detector(net, score="variance", likelihood="regression")
    with pytest.raises(ConfigError, match="likelihood='classification' but the model was wrapped with"):
        posthoc.detector(dac, score="knn", likelihood="classification")
    assert available_scores("regression") == ["mahalanobis", "knn", "variance"]


def _heteroscedastic_net() -> tuple[torch.nn.Module, list, list]:
    """A ``1-32-2`` network trained on noise growing with ``|x|`` to output a mean and a log-variance."""
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 400)[:, None]
    y = torch.sin(x) + 0.1 * (1 + x.abs()) * torch.randn_like(x)
    net = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(300):
        mean, log_var = net(x).chunk(2, -1)
        loss = (0.5 * log_var + 0.5 * (y - mean) ** 2 / log_var.exp()).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    order = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    batches = lambda rows: [(x[rows[i : i + 64]], y[rows[i : i + 64]]) for i in range(0, len(rows), 64)]  # noqa: E731
    return net.eval(), batches(order[:300]), batches(order[300:])


@pytest.mark.parametrize("method", [["none", "dac"], "tta"])
def test_held_out_choices_read_a_heteroscedastic_models_targets_against_its_means(method) -> None:
    """The held-out NLL of a ``(N, 2D)`` model compares the targets with its ``D`` means (they were once read as the
    model's outputs, and every held-out choice under ``likelihood="heteroscedastic"`` failed with an InputError)."""
    net, train, val = _heteroscedastic_net()
    um = posthoc.wrap(net, method=method, likelihood="heteroscedastic").fit(train, val, progress=False)
    std = um.predict(torch.tensor([[0.0], [8.0]])).std.squeeze()
    assert torch.isfinite(std).all()
    if method != "tta":  # dac: far from the training inputs (|x| <= 3) the spread grows
        assert std[1] > 2 * std[0]
