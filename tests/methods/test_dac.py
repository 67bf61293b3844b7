"""``"dac"``: the density-aware per-example temperature (Tomani et al., ICML 2023).

In distribution it leaves the (temperature-scaled) inner predictive alone; far from the training
features it lowers the confidence; it stacks on sampled methods, saves, loads, follows the device,
reads its features from the inner method's own forward pass, and keeps its bank within budget.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
import torchvision.transforms.v2.functional as TF
from torch import nn

import posthoc
from posthoc.engine.feature_bank import Reservoir, kth_distance, normalised, rows_within
from posthoc.errors import ConfigError, HeadNotFoundError
from posthoc.evaluation import metrics
from posthoc.methods.dac.layers import auto_sites
from posthoc.methods.dac.temperature import tempered
from posthoc_apps.demo import zoo


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small models and tiny fits: one thread each (the conftest fixture)."""


@pytest.fixture(scope="module")
def fitted(small) -> dict[str | None, posthoc.UncertainModel]:
    """``["none", "dac"]`` on the bundled CNN, fitted with the perturbed held-out copies and without."""
    return {
        shift: posthoc.wrap(zoo.pretrained(), method=["none", "dac"]).fit(
            small["fit"], small["val"], progress=False, shift=shift
        )
        for shift in ("auto", None)
    }


def _far_inputs(x: torch.Tensor) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "rotated 90": TF.rotate(x, 90.0),
        "heavy noise": x + 2 * torch.randn(x.shape, generator=generator),
        "random": 3 * torch.rand(x.shape, generator=generator) - 0.5,
    }


def test_in_distribution_confidence_is_kept_and_far_inputs_are_less_confident(fitted, digits) -> None:
    um, plain = fitted["auto"], posthoc.wrap(zoo.pretrained(), method="none")
    x, y = digits.test.tensors
    ours, theirs = um.predict(x), plain.predict(x)
    # in distribution: the inner predictive (T0 = 1 in the bulk), up to the default tolerance max(2 %, 0.005 nats)
    assert (ours.confidence - theirs.confidence).abs().mean() < 0.02
    plain_nll = metrics.nll(theirs.probs, y)
    assert metrics.nll(ours.probs, y) <= plain_nll + max(0.02 * plain_nll, 0.005)
    for name, far in _far_inputs(x[:300]).items():
        drop = float((plain.predict(far).confidence - um.predict(far).confidence).mean())
        # 256 held-out digits admit only a weak shrink (the 95 % bound on new data within 0.005 nats): ~0.045 to 0.13
        assert drop > 0.03, (name, drop)
    record = um.summary()["selection"]
    picked = next(row for row in record["candidates"] if row["chosen"])
    assert picked["bound"] <= record["tolerance"] and record["folds"] == 5  # cross-fitted, confidently within
    assert max(um.summary()["posterior"][1]["weights"]) > 0


def test_the_temperature_grows_with_distance_and_is_t0_in_the_bulk(fitted, digits) -> None:
    method = fitted["auto"].method
    x = digits.test.tensors[0][:300]
    with torch.no_grad():
        clean = method.temperatures_of(method._capturer().features([None] * 3, x))
        far = method.temperatures_of(method._capturer().features([None] * 3, TF.rotate(x, 90.0)))
    t0 = float(method.temperature)
    assert float((clean == t0).float().mean()) > 0.75 and (clean >= t0 - 1e-6).all()
    assert float(far.mean()) > float(clean.mean())


def test_shift_changes_the_fitted_weights(fitted) -> None:
    auto, clean = (fitted[s].summary()["posterior"][1] for s in ("auto", None))
    assert clean["shift"] is None and set(auto["shift"]["kinds"]) == {"noise", "blur", "impulse"}
    assert auto["weights"] != pytest.approx(clean["weights"], abs=1e-3)
    assert auto["selection"]["perturbed"] == 3 * auto["selection"]["examples"] and clean["selection"]["perturbed"] == 0
    assert all(row["shifted_nll"] is None for row in clean["selection"]["candidates"])


def test_summary_layers_and_bank(fitted) -> None:
    card = fitted["auto"].summary()["posterior"][1]
    assert card["layers"] == ["features.3", "features.7", "classifier.4:input"]
    widths = 16 + 32 + 64
    assert card["bank_rows"] == 512 and card["bank_bytes"] == 512 * widths * 4
    assert card["random_variables"] == 4 and len(card["weights"]) == 3 and card["k"] == 10
    assert "bank_bytes" in fitted["auto"].summary().to_markdown()


def test_predict_reads_features_from_the_inner_forward_pass(fitted, digits) -> None:
    um = fitted["auto"]
    calls = []
    handle = um.method.base_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        um.predict(digits.test.tensors[0][:64])  # two chunks: 8 examples (the probe), then 56
    finally:
        handle.remove()
    assert len(calls) == 2


def test_stacks_on_laplace_and_mc_dropout_and_alone(small, digits) -> None:
    x = digits.test.tensors[0][:40]
    far = TF.rotate(x, 90.0)
    for chain in (["laplace", "dac"], ["mc-dropout", "dac"]):
        um = posthoc.wrap(zoo.pretrained(), method=chain).fit(small["fit"], small["val"], progress=False, shift=None)
        pred = um.predict(x, generator=torch.Generator().manual_seed(0))
        assert pred.probs.shape == (40, 8)
        if chain[0] == "mc-dropout":  # tempered sample by sample (Laplace's default predictive has no samples)
            assert pred.samples is not None and pred.samples.shape[1:] == (40, 8)
            assert torch.allclose(pred.samples.mean(0), pred.probs, atol=1e-5)
        # against the inner predictive temperature-scaled by T0 (what DAC gives in distribution), same draws
        with torch.no_grad():
            log_probs, samples = um.method.inner.log_predictive(far, generator=torch.Generator().manual_seed(0))
            scaled = tempered(log_probs if samples is None else samples, um.method.temperature.expand(40))[0].exp()
        ours = um.predict(far, generator=torch.Generator().manual_seed(0)).probs
        assert float(ours.max(1).values.mean()) <= float(scaled.max(1).values.mean()) + 1e-4, chain
    alone = posthoc.wrap(zoo.pretrained(), method="dac")
    assert alone.methods == ["dac"] and alone.method.inner.name == "none"


def test_save_and_load_reproduce_the_predictions(fitted, digits, tmp_path) -> None:
    um = fitted["auto"]
    x = digits.test.tensors[0][:100]
    path = tmp_path / "cnn.dac.pt"
    um.save(str(path))
    loaded = posthoc.load(str(path), zoo.pretrained())
    assert torch.equal(loaded.predict(x).probs, um.predict(x).probs)
    assert loaded.summary()["posterior"][1]["layers"] == um.summary()["posterior"][1]["layers"]
    assert loaded.summary()["posterior"][1]["shift"] == um.summary()["posterior"][1]["shift"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_follows_the_model_to_the_gpu(fitted, digits) -> None:
    um = fitted["auto"]
    x = digits.test.tensors[0][:50]
    expected = um.predict(x).probs
    um.cuda()
    try:
        assert um.method.bank.is_cuda
        assert torch.allclose(um.predict(x.cuda()).probs.cpu(), expected, atol=1e-4)
    finally:
        um.cpu()


def test_the_bank_keeps_to_its_budget_and_distances_are_exact(small, digits) -> None:
    widths = 16 + 32 + 64
    budget = 100 * widths * 4 + 7
    um = posthoc.wrap(zoo.pretrained(), method="dac", bank_bytes=budget, k=3).fit(
        small["fit"], small["val"], progress=False, shift=None
    )
    method = um.method
    assert method.bank_rows == rows_within([16, 32, 64], budget) == 100
    assert method.summary()["bank_bytes"] <= budget and method.summary()["training_examples_seen"] == 512
    x = digits.test.tensors[0][:30]
    with torch.no_grad():
        features = method._capturer().features([None] * 3, x)
        got = method.log_distances(features).exp()
    for layer, (f, bank) in enumerate(zip(features, method._banks())):
        brute = torch.cdist(normalised(f).double(), bank.double()).sort(dim=1).values[:, 2]
        assert torch.allclose(got[:, layer].double(), brute, rtol=1e-5, atol=1e-6)
        assert torch.allclose(bank.norm(dim=1), torch.ones(100), atol=1e-5)


def test_reservoir_keeps_a_uniform_subset() -> None:
    counts = torch.zeros(1000)
    for seed in range(200):
        reservoir = Reservoir(100, torch.Generator().manual_seed(seed))
        for start in range(0, 1000, 64):
            reservoir.add(torch.arange(start, min(1000, start + 64), dtype=torch.float32).unsqueeze(1))
        kept = reservoir.rows().squeeze(1)
        assert kept.numel() == 100 and kept.unique().numel() == 100 and reservoir.seen == 1000
        counts[kept.long()] += 1
    # each row is kept with probability 0.1: 20 of 200 runs, standard deviation ~4.2
    assert abs(float(counts[:500].mean()) - float(counts[500:].mean())) < 1.5
    assert 4 < float(counts.min()) and float(counts.max()) < 38


def test_kth_distance_matches_brute_force_in_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    bank, queries = (
        normalised(torch.randn(500, 8, generator=generator)),
        normalised(torch.randn(20, 8, generator=generator)),
    )
    brute = torch.cdist(queries.double(), bank.double()).sort(dim=1).values[:, 6]
    for max_memory in (None, 20 * 4 * 50):  # one block, and blocks of 50 bank rows
        assert torch.allclose(kth_distance(queries, bank, 7, max_memory=max_memory), brute, atol=1e-9)


def test_layers_are_found_and_can_be_named(digits_model) -> None:
    x = torch.zeros(2, 1, 28, 28)
    assert [str(s) for s in auto_sites(zoo.pretrained("digits_bn_cnn"), x)] == ["features.3", "features.7", "fc:input"]
    resnet = torchvision.models.resnet18(num_classes=3).eval()
    assert [str(s) for s in auto_sites(resnet, torch.zeros(2, 3, 32, 32))] == ["layer2", "layer3", "fc:input"]
    um = posthoc.wrap(digits_model, method="dac", layers=["features.7"])
    assert um.method.layers == ["features.7"]


def test_named_layers_are_used(small) -> None:
    um = posthoc.wrap(zoo.pretrained(), method="dac", layers=["features.7"]).fit(
        small["fit"], small["val"], progress=False, shift=None
    )
    card = um.summary()["posterior"][-1]
    assert card["layers"] == ["features.7", "classifier.4:input"] and card["bank_bytes"] == 512 * (32 + 64) * 4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"k": 0}, "k must be a positive integer"),
        ({"anchor": 1.5}, "anchor must be a number strictly between 0 and 1"),
        ({"val_tolerance": 0.01}, "option 'val_tolerance' was removed: every held-out choice now takes one tolerance"),
        ({"shrink": 2}, "shrink must be a number in \\[0, 1\\]"),
        ({"bank_bytes": 0}, "bank_bytes must be a positive number of bytes"),
        ({"layers": ["nope"]}, "no module named 'nope'; available: features"),
        ({"layers": "features.3"}, "layers must be None"),
        ({"bank_size": 10}, r"unknown option\(s\) \['bank_size'\].*dac: k=10, layers=None, bank_bytes=67108864"),
    ],
)
def test_bad_options_are_refused_at_wrap(digits_model, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(digits_model, method=["none", "dac"], **options)


class _Tokens(nn.Module):
    """A dict-input classifier: token embeddings, a mean over positions, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.mix(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((hidden * mask).sum(1) / mask.sum(1))


def test_dict_inputs_work_and_a_model_without_layers_says_what_to_pass() -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (192, 12), generator=generator)
    batches = [
        ({"input_ids": ids[i : i + 64], "attention_mask": torch.ones(64, 12, dtype=torch.long)}, ids[i : i + 64, 0] % 3)
        for i in range(0, 192, 64)
    ]
    um = posthoc.wrap(_Tokens(), method="dac").fit(batches, batches, progress=False)
    assert um.summary()["posterior"][-1]["layers"] == ["embed", "head:input"]
    assert um.predict(batches[0][0]).probs.shape == (64, 3)

    class NoHead(nn.Module):
        def forward(self, x):
            return torch.stack([x.sum(1), -x.sum(1)], 1)

    loader = [(torch.randn(16, 4), torch.randint(0, 2, (16,)))]
    with pytest.raises(HeadNotFoundError, match="layers=\\[module names\\]"):
        posthoc.wrap(NoHead(), method="dac").fit(loader, loader, progress=False, shift=None)
