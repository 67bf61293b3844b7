"""Worker process for tests/engine/test_ensemble_distributed.py (gloo on loopback); not a test module."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import posthoc
from posthoc.methods.ensemble.method import Ensemble


def problem() -> tuple[list[nn.Module], DataLoader, torch.Tensor]:
    """Three small MLPs (members), the whole training data as one loader, and test inputs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).eval())
    return (
        models,
        DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)),
        x[:10],
    )


def fitted(method: str) -> posthoc.UncertainModel:
    """The scenario's ensemble, fitted (the same call in one process and on every rank)."""
    models, loader, _ = problem()
    if method == "multiswag":
        um = posthoc.wrap(models[0], method="multiswag", members=3, subset="last_layer", num_samples=4)
        return um.fit(loader, progress=False, shift=None, epochs=2, collect_per_epoch=2)
    return posthoc.wrap(models, method="laplace", hessian="diag").fit(loader, progress=False, shift=None)


def fit_counting(scenario: str) -> tuple[torch.Tensor, list[int]]:
    """The scenario's predictive on the test inputs, and the members this rank fitted itself."""
    fitted_here: list[int] = []
    original = Ensemble._fit_member

    def counted(self, index, *args, **kwargs):
        fitted_here.append(index)
        return original(self, index, *args, **kwargs)

    Ensemble._fit_member = counted
    try:
        um = fitted(scenario)
    finally:
        Ensemble._fit_member = original
    return um.predict(problem()[2], generator=torch.Generator().manual_seed(0)).probs, fitted_here


def sharded_error() -> str:
    """What fitting an ensemble on loaders sharded by a DistributedSampler says."""
    models, loader, _ = problem()
    sharded = DataLoader(loader.dataset, sampler=DistributedSampler(loader.dataset), batch_size=32)
    try:
        posthoc.wrap(models, method="laplace").fit(sharded, progress=False, shift=None)
    except posthoc.InputError as err:
        return str(err)
    return "no error"


def run(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    """Every scenario in one process group (spawning ranks is the slow part): laplace, multiswag, sharded."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {name: dict(zip(("probs", "fitted_here"), fit_counting(name))) for name in ("laplace", "multiswag")}
        results["sharded"] = sharded_error()
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
