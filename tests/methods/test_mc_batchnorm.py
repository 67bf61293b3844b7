"""``"mc-batchnorm"`` (Teye et al. 2018): agreement with torch-uncertainty's ``MCBatchNorm`` given the same mini-batches,
the refusal of a model without BatchNorm, and the mini-batch size chosen by the selection step (the plain model among
the candidates, so the choice is never worse than it beyond the tolerance)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch_uncertainty.post_processing import mc_batch_norm

import posthoc
from posthoc.engine.bn_refresh import per_batch_statistics
from posthoc.errors import ConfigError
from posthoc.methods.mc_batchnorm.method import BATCH_SIZES


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).eval()


def _images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=generator) * 2 + 1  # statistics far from the running (0, 1)
    return x, torch.randint(0, 3, (n,), generator=generator)


def test_agrees_with_torch_uncertainty_given_the_same_mini_batches() -> None:
    model, (x, y) = _net(), _images(64)
    samples, size = 4, 8
    loader = DataLoader(TensorDataset(x, y), batch_size=size, shuffle=False)
    peer = mc_batch_norm.MCBatchNorm(model, num_estimators=samples, mc_batch_size=size)
    peer.fit(loader)
    test = _images(10, seed=1)[0]
    with torch.no_grad():
        peer_log_probs = torch.log_softmax(peer(test), -1).reshape(samples, 10, 3)
    um = posthoc.wrap(model, method="mc-batchnorm", num_samples=samples, batch_size=size).fit(loader, progress=False)
    batches = [x[k * size : (k + 1) * size] for k in range(samples)]  # the peer's: the loader's first batches in order
    um.method.means[0], um.method.variances[0] = per_batch_statistics(model, batches)
    ours = um.predict(test)
    torch.testing.assert_close(ours.samples.log(), peer_log_probs, atol=1e-5, rtol=1e-5)  # float32, other op order
    torch.testing.assert_close(ours.probs, peer_log_probs.exp().mean(0), atol=1e-6, rtol=1e-5)


def test_a_model_without_batchnorm_and_a_bad_batch_size_are_refused() -> None:
    with pytest.raises(ConfigError, match="this model has none: use method='mc-dropout'"):
        posthoc.wrap(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), method="mc-batchnorm")
    with pytest.raises(ConfigError, match="batch_size must be an integer of at least 2 or 'auto'"):
        posthoc.wrap(_net(), method="mc-batchnorm", batch_size=1)
    assert not posthoc.wrap(_net(), method="auto").method.__class__.__name__ == "MCBatchNorm"


def test_the_batch_size_is_chosen_by_the_selection_step_from_the_plain_model_up(tmp_path) -> None:
    model = _net()
    x, y = _images(600)
    fit, val = (
        DataLoader(TensorDataset(x[:400], y[:400]), batch_size=100),
        DataLoader(TensorDataset(x[400:], y[400:]), batch_size=100),
    )
    um = posthoc.wrap(model, method="mc-batchnorm", num_samples=4).fit(fit, val, progress=False, shift=None)
    record = um.summary()["selection"]
    labels = [c["candidate"] for c in record["candidates"]]
    assert labels[0] == "plain" and labels[1:] == [f"b={b}" for b in BATCH_SIZES][: len(labels) - 1]
    chosen = um.method.summary()["batch_size"]
    assert record["chosen"] == ("plain" if chosen is None else f"b={chosen}")
    pred = um.predict(x[:5])
    assert (pred.samples is None) == (chosen is None)
    um.save(tmp_path / "m.pt")
    assert torch.equal(posthoc.load(tmp_path / "m.pt", model).predict(x[:5]).probs, pred.probs)
