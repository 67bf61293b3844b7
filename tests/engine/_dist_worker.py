"""Worker process for tests/engine/test_distributed.py (gloo on loopback); not a test module."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

import posthoc
from posthoc_apps.demo import data, zoo

#: rank 0 gets more examples (and batches) than rank 1: uneven shards must not hang
SHARD_SIZES = (350, 250)


#: (method, options, fit options) of the methods that fit weights by gradient steps (tests/engine/test_distributed.py)
WEIGHT_CASES = (
    ("vi", {}, {"epochs": 1}),
    ("sparse-vd", {"layers": "head"}, {"epochs": 1}),
    ("sgld", {"layers": "head", "num_samples": 4}, {"epochs": 1}),
    ("ivon", {"layers": "head", "num_samples": 4}, {"epochs": 1}),
    ("abnn", {"modes": 2, "num_samples": 2, "scale": 1.0}, {"epochs": 1}),
)


def shards(dataset):
    bounds = [0, SHARD_SIZES[0], SHARD_SIZES[0] + SHARD_SIZES[1]]
    return [Subset(dataset, range(bounds[i], bounds[i + 1])) for i in range(2)]


def swag_problem():
    """A small MLP and data laid out so that rank r's batch k (16 examples) is half of batch k of one process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    rank_of = (torch.arange(128) // 16) % 2
    return model, x, y, rank_of


def swag_results(um, x):
    return {
        "mean": um.method.collector.mean.clone(),
        "variance": um.method.collector.variance.clone(),
        "probs": um.predict(x[:20]).probs,
    }


def run(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        splits = data.load_digits()
        model = zoo.pretrained()
        if scenario == "wrong-world-size":
            sampler = DistributedSampler(splits.calibration, num_replicas=3, rank=rank, shuffle=False)
            try:
                posthoc.wrap(model, method="temperature").fit(
                    val_loader=DataLoader(splits.calibration, sampler=sampler), progress=False, shift=None
                )
            except posthoc.InputError as err:
                torch.save({"error": str(err)}, f"{out}/rank{rank}.pt")
            return
        if scenario == "swag":
            model, x, y, rank_of = swag_problem()
            loader = DataLoader(torch.utils.data.TensorDataset(x[rank_of == rank], y[rank_of == rank]), batch_size=16)
            results = {}
            for subset in ("all", "last_layer"):
                um = posthoc.wrap(model, method="swag", subset=subset)
                um.fit(loader, progress=False, shift=None, epochs=2, lr=0.05, collect_per_epoch=2)
                results[subset] = swag_results(um, x)
            torch.save(results, f"{out}/rank{rank}.pt")
            return
        if scenario == "ibnn":
            fit = DataLoader(shards(splits.fit)[rank], batch_size=64)
            um = posthoc.wrap(model, method="ibnn", components=2, num_samples=1)
            um.fit(fit, progress=False, shift=None, epochs=1, lr_nodes=0.5, train_samples=2)
            torch.save(
                {
                    "nodes": {k: v.clone() for k, v in um.method.nodes.state_dict().items()},
                    "probs": um.predict(splits.test.tensors[0][:20], generator=torch.Generator().manual_seed(0)).probs,
                },
                f"{out}/rank{rank}.pt",
            )
            return
        if scenario == "weights":
            fit = DataLoader(
                shards(splits.fit)[rank], batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(rank)
            )
            x = splits.test.tensors[0][:20]
            results = {}
            for name, options, fit_options in WEIGHT_CASES:
                um = posthoc.wrap(model, method=name, **options).fit(fit, progress=False, shift=None, **fit_options)
                results[name] = {
                    "state": um.method.posterior_state(),
                    "probs": um.predict(x, generator=torch.Generator().manual_seed(0)).probs,
                }
            torch.save(results, f"{out}/rank{rank}.pt")
            return
        if scenario == "laplace":
            fit = DataLoader(shards(splits.fit)[rank], batch_size=64)
            results = {}
            for hessian in ("kron", "diag"):
                um = posthoc.wrap(model, method="laplace", hessian=hessian).fit(fit, progress=False, shift=None)
                results[hessian] = {
                    "prior": um.method.prior_precision.clone(),
                    "probs": um.predict(splits.test.tensors[0][:50]).probs,
                }
            torch.save(results, f"{out}/rank{rank}.pt")
            return
        cal = DataLoader(shards(splits.calibration)[rank], batch_size=64)
        test = DataLoader(shards(splits.test)[rank], batch_size=64)
        um = posthoc.wrap(model, method="temperature").fit(val_loader=cal, progress=False, shift=None)
        report = posthoc.evaluate(um, test, progress=False)
        torch.save(
            {
                "temperature": um.method.temperature.clone(),
                "nll": report.nll,
                "ece": report.ece,
                "n": len(report.labels),
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
