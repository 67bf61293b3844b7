"""Laplace: one registered name, two algorithm classes chosen at wrap(); chunks planned up front."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.chunks import budget_scope
from posthoc.methods.laplace import Laplace, LastLayerLaplace, SubsetLaplace, subset_glm
from posthoc.methods.laplace.glm_predictive import LogitGaussian, chunked_log_predictive


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


def loader(n: int = 60) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (n,), generator=generator)), batch_size=20)


def test_the_registered_front_lists_the_options_and_picks_the_algorithm() -> None:
    assert posthoc.core.registry.REGISTRY["laplace"] is Laplace
    assert set(posthoc.available_methods()["laplace"]) == {
        "hessian",
        "subset",
        "prior_precision",
        "link",
        "pred",
        "num_samples",
        "head",
    }
    assert Laplace.algorithm({}) is LastLayerLaplace
    assert Laplace.algorithm({"subset": "last_layer"}) is LastLayerLaplace
    assert Laplace.algorithm({"subset": "all"}) is SubsetLaplace
    assert Laplace.algorithm({"subset": ["2", "4"]}) is SubsetLaplace


@pytest.mark.parametrize("options, algorithm", [({}, LastLayerLaplace), ({"subset": "all"}, SubsetLaplace)])
def test_wrap_builds_the_algorithm_and_it_round_trips(tmp_path, options: dict, algorithm: type) -> None:
    model = mlp()
    um = posthoc.wrap(model, method="laplace", **options).fit(loader(), progress=False)
    assert type(um.method) is algorithm and isinstance(um.method, Laplace)
    assert um.method.pred == "glm" and float(um.method.prior_precision) > 0
    x = loader(9).dataset.tensors[0]
    um.save(tmp_path / "posterior.pt")
    loaded = posthoc.load(tmp_path / "posterior.pt", model)
    assert type(loaded.method) is algorithm
    torch.testing.assert_close(loaded.predict(x).probs, um.predict(x).probs)
    assert float(loaded.method.log_marginal_likelihood()) == pytest.approx(um.method.log_marginal_likelihood())


def test_subset_glm_chunks_are_planned_before_the_first_one(monkeypatch) -> None:
    """Every chunk has the planner's size for the declared per-row bytes: no one-row first chunk."""
    model = mlp()
    um = posthoc.wrap(model, method="laplace", subset=["2", "4"]).fit(loader(), progress=False)
    budget = 20 * subset_glm.bytes_per_row(um.method.glm_layers, 3)
    sizes, original = [], subset_glm.logit_gaussian
    monkeypatch.setattr(subset_glm, "logit_gaussian", lambda *args: sizes.append(args[3].shape[0]) or original(*args))
    x = loader(50).dataset.tensors[0]
    whole = um.method.log_predictive(x)[0]
    assert sizes == [50]
    with posthoc.settings.override(max_memory=budget):
        chunked = um.method.log_predictive(x)[0]
    assert sizes[1:] == [20, 20, 10]
    torch.testing.assert_close(chunked, whole)


def test_chunked_mc_predictive_joins_rows_and_samples() -> None:
    mean = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))

    def gaussian(rows: slice) -> LogitGaussian:
        return LogitGaussian(mean[rows], torch.full_like(mean[rows], 0.5), None)

    sizes = []
    with budget_scope(300):
        log_probs, samples = chunked_log_predictive(
            7,
            100,
            lambda rows: sizes.append(rows.stop - rows.start) or gaussian(rows),
            "mc",
            5,
            torch.Generator().manual_seed(0),
        )
    assert sizes == [3, 3, 1] and samples.shape == (5, 7, 3)
    torch.testing.assert_close(log_probs.exp(), samples.exp().mean(0))


def test_a_regressions_held_out_noise_is_chosen_by_choose_after_fit_never_inside_fit() -> None:
    """``fit`` reads the training data only (the evidence's noise); the held-out noise is the selection step's, which
    ``um.fit(train, val)`` runs after it and ``um.choose(val)`` re-runs: both land on the same noise and prior."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=generator, dtype=torch.float64)
    y = x[:, :1].sin() + 0.3 * torch.randn(120, 1, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(300):  # over-fits the 60 training rows: held-out residuals are wider than the evidence's noise
        optimiser.zero_grad()
        nn.functional.mse_loss(net(x[:60]), y[:60]).backward()
        optimiser.step()
    net.eval()
    train = DataLoader(TensorDataset(x[:60], y[:60]), batch_size=30)
    val = DataLoader(TensorDataset(x[60:], y[60:]), batch_size=30)
    alone = posthoc.wrap(net, method="laplace", likelihood="regression").method
    assert alone.knob() is not None  # a held-out choice: the noise
    alone.fit(train, val, progress=False)  # the method's own fit, without the runner's selection step
    assert alone.likelihood.summary()["noise_fit"] == "marglik"
    fitted = posthoc.wrap(net, method="laplace", likelihood="regression").fit(train, progress=False)
    assert fitted.method.likelihood.summary()["noise_fit"] == "marglik"
    fitted.choose(val, progress=False)
    both = posthoc.wrap(net, method="laplace", likelihood="regression").fit(train, val, progress=False)
    for um in (fitted, both):
        assert um.method.likelihood.summary()["noise_fit"] == "held-out"
    assert float(fitted.method.likelihood.noise_std) == float(both.method.likelihood.noise_std)
    assert float(fitted.method.prior_precision) == float(both.method.prior_precision)
