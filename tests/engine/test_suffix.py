"""The stochastic-suffix engine: prefix once, samples batched, fallback around skip paths, chunking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posthoc.engine.suffix import SuffixRunner, expanded_forward
from posthoc.errors import ConfigError
from posthoc.methods.mc_dropout.masks import keep_mask, keep_probability
from posthoc.methods.mc_dropout.sites import DropoutSite, sampling
from posthoc.methods.swag.sampled_linears import sampled_linears


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4)).eval()


class Residual(nn.Module):
    """A block whose skip path bypasses ``branch``: expanding at ``branch`` alone is unsound."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.branch = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.branch(h))


def _count_calls(module: nn.Module) -> tuple[list[int], object]:
    rows: list[int] = []
    return rows, module.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[0]))


def test_prefix_runs_once_and_suffix_on_all_samples() -> None:
    net, x = _mlp(), torch.randn(5, 6)
    prefix_rows, h1 = _count_calls(net[0])
    suffix_rows, h2 = _count_calls(net[3])
    runner = SuffixRunner(net, "2", at="output")
    out = runner(x, 7)
    h1.remove(), h2.remove()
    assert out.shape == (7, 5, 4)
    # the probe sees 2 rows once; the real call runs the prefix on the 5 examples exactly once
    assert prefix_rows == [2, 5] and suffix_rows == [4, 35]
    assert runner.expands_input is False
    # deterministic suffix: every sample equals the plain forward pass
    torch.testing.assert_close(out, net(x).expand(7, 5, 4))


def test_the_plan_is_made_once_and_scaled_for_other_input_sizes() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).eval()
    rows, hook = _count_calls(net[0])
    runner = SuffixRunner(net, "2", max_memory=10**9)
    runner.prepare(torch.randn(3, 1, 8, 8))
    small = runner(torch.randn(5, 1, 8, 8), 4)
    large = runner(torch.randn(5, 1, 16, 16), 4)
    hook.remove()
    assert rows == [2, 5, 5]  # one probe of 2 rows, then each call's prefix only
    assert small.shape == large.shape == (4, 5, 3)
    assert runner._plan.row_bytes_for(torch.randn(1, 1, 16, 16)) == 4 * runner._plan.row_bytes_for(
        torch.randn(1, 1, 8, 8)
    )


def test_head_batched_equals_full_forward_passes_with_same_masks() -> None:
    net, x, samples = _mlp(), torch.randn(5, 6), 9
    sites = [DropoutSite("2", "output", 0.3)]

    def run(start: str | None) -> torch.Tensor:
        g = torch.Generator().manual_seed(3)
        return expanded_forward(
            net, start, x, samples, at="output", stochastic=lambda: sampling(net, sites, generator=g)
        )

    batched, full = run("2"), run(None)
    torch.testing.assert_close(batched, full)
    # and both equal an explicit loop over samples with the masks drawn in the same order
    keep = keep_mask((samples * 5, 16), 0.3, generator=torch.Generator().manual_seed(3), device="cpu")
    hidden = net[1](net[0](x))
    for s in range(samples):
        dropped = hidden * keep[s * 5 : (s + 1) * 5] / keep_probability(0.3)
        torch.testing.assert_close(batched[s], net[3](dropped))
    assert not torch.allclose(batched[0], batched[1])


def test_skip_path_around_expansion_point_falls_back_to_input_expansion() -> None:
    torch.manual_seed(0)
    net, x = Residual().eval(), torch.randn(4, 6)
    sites = [DropoutSite("branch", "input", 0.5)]
    runner = SuffixRunner(net, "branch")
    g = torch.Generator().manual_seed(1)
    out = runner(x, 6, stochastic=lambda: sampling(net, sites, generator=g))
    assert runner.expands_input is True
    keep = keep_mask((6 * 4, 16), 0.5, generator=torch.Generator().manual_seed(1), device="cpu")
    for s in range(6):
        h = net.stem(x)
        expected = net.head(h + net.branch(h * keep[s * 4 : (s + 1) * 4] / keep_probability(0.5)))
        torch.testing.assert_close(out[s], expected)


@pytest.mark.parametrize("max_memory", [1, 200, 10**9])
def test_chunking_keeps_results_and_layout(max_memory: int) -> None:
    net, x = _mlp(), torch.randn(7, 6)
    layouts = []
    hook = net[3].register_forward_pre_hook(lambda m, a: layouts.append(runner.layout))
    runner = SuffixRunner(net, "2", at="output", max_memory=max_memory)
    out = runner(x, 5)
    hook.remove()
    torch.testing.assert_close(out, net(x).expand(5, 7, 4))
    real = layouts[1:]  # the first call is the probe
    assert sum(layout.samples * layout.examples for layout in real) == 35
    if max_memory == 10**9:
        assert len(real) == 1
    else:
        assert len(real) > 1


def test_dict_inputs_and_errors() -> None:
    class KeywordNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp()

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.body(pixels)

    net = KeywordNet().eval()
    out = expanded_forward(net, "body.2", {"pixels": torch.randn(3, 6)}, 4, at="output")
    assert out.shape == (4, 3, 4)
    with pytest.raises(ConfigError, match="no module named"):
        SuffixRunner(net, "nope")
    with pytest.raises(ConfigError, match="num_samples"):
        SuffixRunner(net, "body.2")({"pixels": torch.randn(3, 6)}, 0)
    with pytest.raises(ConfigError, match="at must be"):
        SuffixRunner(net, "body.2", at="middle")


def test_keep_mask_rate_and_independence() -> None:
    keep = keep_mask((4000, 50), 0.2, generator=torch.Generator().manual_seed(0), device="cpu").float()
    assert abs(keep.mean().item() - keep_probability(0.2)) < 0.005
    corr = torch.corrcoef(keep[:, :10].T)  # columns across rows: independent entries
    assert (corr - torch.eye(10)).abs().max() < 0.06
    assert keep_mask((3, 3), 0.0, generator=None, device="cpu").all()


def test_sampled_linears_apply_each_samples_weights_also_across_sample_groups() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(7, 3)
    weights = {"2.weight": torch.randn(5, 2, 4), "2.bias": torch.randn(5, 2)}
    expected = torch.stack(
        [torch.func.functional_call(net, {name: value[s] for name, value in weights.items()}, (x,)) for s in range(5)]
    )
    for max_memory in (None, 64):  # 64 bytes: samples run in groups of 4 and 1, one example at a time
        runner = SuffixRunner(net, "2", max_memory=max_memory)
        got = runner(x, 5, stochastic=lambda: sampled_linears(net, weights, runner))
        torch.testing.assert_close(got, expected)
    assert not net[2]._forward_hooks
