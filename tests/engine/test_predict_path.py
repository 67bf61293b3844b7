"""The predict path: the budget reaches the method through the runner's scope (never an argument, never the global
setting), and Laplace's predict runs the model once per chunk (no probe forwards)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.inputs import all_finite
from posthoc.engine.uncertain_model import PROBE_EXAMPLES, UncertainModel


class Recorder(posthoc.Method):
    """A deterministic predictive that records the rows and the budget of every call."""

    name, requires_fit = "test-recorder", False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.calls: list[tuple[int, int | None, int]] = []

    def log_predictive(self, x, *, num_samples=None, generator=None):
        self.calls.append((x.shape[0], posthoc.settings.memory_budget(), posthoc.settings.max_memory))
        return torch.log_softmax(self.model(x), -1), None


def test_the_budget_is_the_runners_scope_not_a_setting() -> None:
    um = UncertainModel(Recorder(nn.Linear(3, 4)), [])
    setting = posthoc.settings.max_memory
    um.predict(torch.randn(50, 3), max_memory=2**20)
    assert um.method.calls == [(PROBE_EXAMPLES, 2**19, setting), (50 - PROBE_EXAMPLES, 2**19, setting)]
    assert posthoc.settings.memory_budget() == setting  # the scope ends with the call
    wrapped = UncertainModel(
        Recorder(nn.Linear(3, 4)), [{"name": "test-recorder", "options": {}, "run": {"max_memory": 2**22}}]
    )
    wrapped.predict(torch.randn(4, 3))
    assert wrapped.method.calls == [(4, 2**21, setting)]  # the wrap's max_memory, less the samples' share


def test_laplace_predict_runs_the_model_once_per_chunk() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    for options in ({"hessian": "kron"}, {"hessian": "full"}, {"subset": ["2", "4"]}):
        um = posthoc.wrap(model, method="laplace", prior_precision=1.0, **options).fit(loader, progress=False)
        sizes: list[int] = []
        handle = model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
        try:
            um.predict(x[:40])
        finally:
            handle.remove()
        assert sizes == [PROBE_EXAMPLES, 40 - PROBE_EXAMPLES], (options, sizes)  # the chunks, and nothing else


def test_all_finite_reads_a_sum_and_checks_element_by_element_only_when_it_is_not_finite() -> None:
    assert all_finite(torch.full((4,), 3e38)) and all_finite(torch.full((3,), 6e4, dtype=torch.float16))
    assert not all_finite(torch.tensor([1.0, float("nan")])) and not all_finite(
        torch.tensor([float("inf"), -float("inf")])
    )
    assert not all_finite({"x": torch.ones(2), "y": torch.tensor([0.0, float("inf")])}) and all_finite(
        {"ids": torch.tensor([1, 2])}
    )


def test_eval_mode_restores_every_flag_also_one_the_block_switched() -> None:
    from posthoc.core.modules import eval_mode

    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).eval()
    with eval_mode(net):
        net.train()  # a fine-tune inside the block
    assert not any(module.training for module in net.modules())  # back to the caller's eval mode
    net.train()
    with eval_mode(net, list(net.modules())):
        assert not any(module.training for module in net.modules())
    assert all(module.training for module in net.modules())


class NaNRow(posthoc.Method):
    """Log-probabilities with one NaN in one row of the second chunk."""

    name, requires_fit = "test-nan-row", False

    def log_predictive(self, x, *, num_samples=None, generator=None):
        log_probs = torch.log_softmax(self.model(x), -1)
        if x.shape[0] > PROBE_EXAMPLES:
            log_probs[-1, 1] = float("nan")
        return log_probs, None


def test_a_nan_log_probability_is_refused_and_chunks_write_in_place() -> None:
    """One NaN among the (N, C) log-probabilities is refused (the check reads each row's largest probability);
    the chunks' probabilities written straight into the output equal a one-chunk predict's."""
    torch.manual_seed(0)
    model, x = nn.Linear(3, 4), torch.randn(50, 3)
    with pytest.raises(posthoc.NumericalError, match="produced NaN"):
        UncertainModel(NaNRow(model), []).predict(x)
    um = UncertainModel(Recorder(model), [])
    chunked, whole = um.predict(x, chunk_size=16), um.predict(x, chunk_size=64)
    assert [rows for rows, _, _ in um.method.calls] == [PROBE_EXAMPLES, 16, 16, 10, PROBE_EXAMPLES, 50 - PROBE_EXAMPLES]
    for name in ("probs", "entropy", "confidence", "label"):
        assert torch.allclose(getattr(chunked, name).float(), getattr(whole, name).float(), atol=1e-6), name
    assert torch.allclose(chunked.probs, torch.softmax(model(x), -1).detach(), atol=1e-6)
