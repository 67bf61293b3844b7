"""Fitting on torch.distributed: 2 gloo processes on loopback, spawned here, bounded in time."""

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import ConcatDataset, DataLoader

import posthoc

sys.path.insert(0, str(Path(__file__).parent))
import _dist_worker  # noqa: E402

TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path: Path, scenario: str) -> list[dict]:
    context = mp.start_processes(
        _dist_worker.run, args=(2, _free_port(), str(tmp_path), scenario), nprocs=2, join=False, start_method="spawn"
    )
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s (hang?)")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_two_ranks_with_uneven_shards_equal_one_process_on_the_union(tmp_path, digits_model, digits):
    ranks = _launch(tmp_path, "fit")
    assert torch.equal(ranks[0]["temperature"], ranks[1]["temperature"])
    assert ranks[0]["nll"] == ranks[1]["nll"] and ranks[0]["n"] == 600

    union_cal = DataLoader(ConcatDataset(_dist_worker.shards(digits.calibration)), batch_size=64)
    union_test = DataLoader(ConcatDataset(_dist_worker.shards(digits.test)), batch_size=64)
    single = posthoc.wrap(digits_model, method="temperature").fit(val_loader=union_cal, progress=False, shift=None)
    report = posthoc.evaluate(single, union_test, progress=False)
    assert float(ranks[0]["temperature"]) == pytest.approx(float(single.method.temperature), rel=1e-5)
    assert ranks[0]["nll"] == pytest.approx(report.nll, rel=1e-5)
    assert ranks[0]["ece"] == pytest.approx(report.ece, abs=1e-6)


def test_laplace_curvature_is_summed_over_ranks(tmp_path, digits_model, digits):
    ranks = _launch(tmp_path, "laplace")
    union = DataLoader(ConcatDataset(_dist_worker.shards(digits.fit)), batch_size=64)
    for hessian in ("kron", "diag"):
        assert torch.equal(ranks[0][hessian]["prior"], ranks[1][hessian]["prior"])
        single = posthoc.wrap(digits_model, method="laplace", hessian=hessian).fit(union, progress=False, shift=None)
        assert float(ranks[0][hessian]["prior"]) == pytest.approx(float(single.method.prior_precision), rel=1e-6)
        expected = single.predict(digits.test.tensors[0][:50]).probs
        torch.testing.assert_close(ranks[0][hessian]["probs"], expected, atol=1e-6, rtol=0)


def test_swag_fine_tuning_on_two_ranks_equals_one_process_with_the_joint_batches(tmp_path):
    ranks = _launch(tmp_path, "swag")
    model, x, y, rank_of = _dist_worker.swag_problem()
    # one process: batch k holds rank 0's batch k, then rank 1's batch k (DDP averages their gradients)
    order = torch.cat(
        [torch.cat([torch.nonzero(rank_of == r).squeeze(1)[16 * k : 16 * (k + 1)] for r in (0, 1)]) for k in range(4)]
    )
    loader = DataLoader(torch.utils.data.TensorDataset(x[order], y[order]), batch_size=32)
    for subset in ("all", "last_layer"):
        for key in ("mean", "variance", "probs"):
            torch.testing.assert_close(ranks[0][subset][key], ranks[1][subset][key], rtol=0, atol=0)
        um = posthoc.wrap(model, method="swag", subset=subset)
        um.fit(loader, progress=False, shift=None, epochs=2, lr=0.05, collect_per_epoch=2)
        single = _dist_worker.swag_results(um, x)
        for key in ("mean", "variance", "probs"):
            torch.testing.assert_close(ranks[0][subset][key], single[key], rtol=1e-4, atol=1e-6)


def test_ibnn_node_posteriors_stay_identical_on_every_rank(tmp_path, digits_model, digits):
    ranks = _launch(tmp_path, "ibnn")
    start = posthoc.wrap(digits_model, method="ibnn", components=2, num_samples=1).method.nodes.state_dict()
    for key, value in ranks[0]["nodes"].items():
        assert torch.equal(value, ranks[1]["nodes"][key]), key
    assert any(not torch.equal(value, start[key]) for key, value in ranks[0]["nodes"].items())  # it did train
    assert torch.equal(ranks[0]["probs"], ranks[1]["probs"])


def test_gradient_fitted_posteriors_are_identical_on_every_rank(tmp_path, digits_model):
    """vi, sparse-vd, sgld, ivon and abnn on two uneven, differently shuffled shards: gradients averaged, the likelihood's N
    summed and the steps cut to the shorter shard, so both ranks end with one posterior (and it moved from the start)."""
    ranks = _launch(tmp_path, "weights")
    for name, options, _ in _dist_worker.WEIGHT_CASES:
        start = posthoc.wrap(digits_model, method=name, **options).method.posterior_state()
        first, second = ranks[0][name]["state"], ranks[1][name]["state"]
        assert first.keys() == second.keys()
        for key in first:
            torch.testing.assert_close(
                first[key], second[key], rtol=1e-5, atol=1e-6, equal_nan=True, msg=f"{name}: {key}"
            )
        moved = [
            key
            for key in first
            if key in start
            and start[key].shape == first[key].shape
            and start[key].is_floating_point()
            and not torch.allclose(start[key], first[key])
        ]
        assert moved or any(key not in start or start[key].shape != first[key].shape for key in first), name
        torch.testing.assert_close(ranks[0][name]["probs"], ranks[1][name]["probs"], rtol=1e-4, atol=1e-6)


def test_sampler_for_another_world_size_is_refused(tmp_path):
    ranks = _launch(tmp_path, "wrong-world-size")
    for result in ranks:
        assert "3 replicas" in result["error"] and "world size 2" in result["error"]
