"""Laplace: one registered name, two algorithm classes chosen at wrap(); chunks planned up front."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.chunks import budget_scope
from posthoc.methods.laplace import LastLayerLaplace, Laplace, SubsetLaplace, subset_glm
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
    assert set(posthoc.available_methods()["laplace"]) == {"hessian", "subset", "prior_precision", "link", "pred", "num_samples", "head"}
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
        log_probs, samples = chunked_log_predictive(7, 100, lambda rows: sizes.append(rows.stop - rows.start) or gaussian(rows),
                                                    "mc", 5, torch.Generator().manual_seed(0))
    assert sizes == [3, 3, 1] and samples.shape == (5, 7, 3)
    torch.testing.assert_close(log_probs.exp(), samples.exp().mean(0))
