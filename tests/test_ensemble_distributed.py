"""Ensembles on torch.distributed: members spread over 2 gloo ranks, each fitted once, equal to one process."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _ensemble_dist_worker as worker  # noqa: E402

TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path: Path, scenario: str) -> list[dict]:
    context = mp.start_processes(worker.run, args=(2, _free_port(), str(tmp_path), scenario), nprocs=2,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s (hang?)")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("scenario", ["laplace", "multiswag"])
def test_members_are_fitted_once_across_ranks_and_equal_one_process(tmp_path, scenario):
    ranks = _launch(tmp_path, scenario)
    assert ranks[0]["fitted_here"] == [0, 2] and ranks[1]["fitted_here"] == [1]  # round robin, each member once
    torch.testing.assert_close(ranks[0]["probs"], ranks[1]["probs"], rtol=0, atol=0)
    single = worker.fitted(scenario).predict(worker.problem()[2], generator=torch.Generator().manual_seed(0)).probs
    torch.testing.assert_close(ranks[0]["probs"], single, rtol=1e-5, atol=1e-6)


def test_sharded_loaders_are_refused_for_an_ensemble(tmp_path):
    for result in _launch(tmp_path, "sharded"):
        assert "give every rank the full loaders" in result["error"]
