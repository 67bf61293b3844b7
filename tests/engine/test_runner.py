"""The runner (posthoc/engine/runner.py): the memory budget reaches the chunk planner through a scope, a wrap's
``max_memory`` is a run option (saved, and lifted from an earlier release's method options), the thread policy never
narrows while another Python thread lives unless told to, and statistics are summed over ranks (themselves in one process)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.chunks import budget_scope, rows_per_chunk
from posthoc.core.threads import single_thread_if
from posthoc.engine.runner import RunOptions, split_run_options, sum_over_ranks
from posthoc.errors import ConfigError


def test_the_budget_scope_plans_chunks_and_ends_with_its_block() -> None:
    setting = posthoc.settings.max_memory
    with budget_scope(4000):
        assert rows_per_chunk(40) == 100 and posthoc.settings.memory_budget() == 4000
        with budget_scope(None):  # keeps the enclosing budget
            assert rows_per_chunk(40) == 100
        assert rows_per_chunk(40, max_memory=400) == 10  # an explicit budget still wins
    assert posthoc.settings.memory_budget() == setting


def test_max_memory_is_a_run_option_saved_with_the_spec(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,))), batch_size=20)
    um = posthoc.wrap(model, method="laplace", max_memory=2**22, prior_precision=1.0).fit(loader, progress=False)
    assert um.run == RunOptions(max_memory=2**22) and um.spec[0]["run"] == {"max_memory": 2**22}
    assert "max_memory" not in um.spec[0]["options"]
    um.save(tmp_path / "p.pt")
    assert posthoc.load(tmp_path / "p.pt", model).run == RunOptions(max_memory=2**22)
    # a file of an earlier release kept it among the method's options
    old = [{"name": "laplace", "options": {"max_memory": 2**21, "hessian": "kron"}}]
    assert RunOptions.from_spec(old) == RunOptions(max_memory=2**21)
    assert split_run_options({"max_memory": 5, "p": 0.1}) == ({"max_memory": 5}, {"p": 0.1})
    with pytest.raises(ConfigError, match="max_memory must be a positive number of bytes"):
        posthoc.wrap(model, method="laplace", max_memory=-3)


def test_the_thread_policy_never_narrows_beside_another_python_thread() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: nothing to narrow")
    seen = []
    stop = threading.Event()
    neighbour = threading.Thread(target=stop.wait)
    with posthoc.settings.override(narrow_threads="auto"):
        with single_thread_if(True):
            seen.append(torch.get_num_threads())  # alone: narrowed
        neighbour.start()
        try:
            with single_thread_if(True):
                seen.append(torch.get_num_threads())  # a server's second thread is alive: untouched
        finally:
            stop.set()
            neighbour.join()
    with posthoc.settings.override(narrow_threads=False), single_thread_if(True):
        seen.append(torch.get_num_threads())
    threads = torch.get_num_threads()
    assert seen == [1, threads, threads]
    with pytest.raises(ConfigError, match="narrow_threads must be True, False or 'auto'"):
        with posthoc.settings.override(narrow_threads="sometimes"):
            pass


def test_sum_over_ranks_is_the_statistics_themselves_in_one_process() -> None:
    stats = {"gram": torch.eye(2), "count": 3, "pos": [torch.tensor(2.0)]}
    assert sum_over_ranks(stats) is stats
