"""Ensembles on torch.distributed: members spread over 2 gloo ranks, each fitted once, equal to one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _ensemble_dist_worker as worker  # noqa: E402
import test_distributed  # noqa: E402


@pytest.fixture()
def launch(monkeypatch):
    """test_distributed's launcher (2 spawned gloo ranks, bounded in time) running this file's worker."""
    monkeypatch.setattr(test_distributed, "_dist_worker", worker)
    return test_distributed._launch


def test_members_are_fitted_once_across_ranks_equal_one_process_and_need_whole_loaders(tmp_path, launch):
    ranks = launch(tmp_path, "all")
    for scenario in ("laplace", "multiswag"):
        first, second = ranks[0][scenario], ranks[1][scenario]
        assert first["fitted_here"] == [0, 2] and second["fitted_here"] == [1], scenario  # round robin, once each
        torch.testing.assert_close(first["probs"], second["probs"], rtol=0, atol=0)
        single = worker.fitted(scenario).predict(worker.problem()[2], generator=torch.Generator().manual_seed(0)).probs
        torch.testing.assert_close(first["probs"], single, rtol=1e-5, atol=1e-6)
    assert all("give every rank the full loaders" in rank["sharded"] for rank in ranks)
