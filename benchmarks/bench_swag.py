"""SWAG speed on the bundled digits CNN: predict (S=20) vs a forward pass and torch-uncertainty's
SWAG, last-layer SWAG predict, SWAG over the two Linear layers (prefix once, and one pass per
sample for comparison), and the cost of a fine-tuning epoch with collection.

Run by hand::

    python benchmarks/bench_swag.py --threads 1     # add --repeats 7 on a quiet machine
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn.functional as F

import posthoc
from posthoc.demo import data, zoo
from timing import HEADER, Timing, measure, row

SAMPLES = 20


def paired(name: str, method, reference, repeats: int) -> str:
    """Time ``reference`` and ``method`` back to back; the row's ratios are to this reference."""
    base = measure(reference, repeats=repeats)
    timing = measure(method, repeats=repeats)
    return ratio_row(name, timing, base)


def ratio_row(name: str, timing: Timing, base: Timing) -> str:
    """:func:`timing.row` plus the ratio of process CPU times (less sensitive to a busy neighbour)."""
    return row(name, timing, base) + f" {timing.cpu / base.cpu:.2f}x |"


def plain_epoch(model: torch.nn.Module, loader, lr: float) -> None:
    """One ordinary SGD (momentum 0.9) training epoch: the reference for the fine-tuning cost."""
    work = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(work.parameters(), lr=lr, momentum=0.9)
    for x, y in loader:
        loss = F.cross_entropy(work(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def torch_uncertainty_swag(model: torch.nn.Module, loader, lr: float, epochs: int, per_epoch: int):
    """torch-uncertainty's SWAG on the same fine-tuning schedule (snapshots at the same steps)."""
    from torch_uncertainty.methods.swag import SWAG as TUSWAG

    tu = TUSWAG(copy.deepcopy(model), cycle_start=0, cycle_length=1, scale=0.5, max_num_models=20, num_estimators=SAMPLES)
    tu.train()
    optimizer = torch.optim.SGD(tu.core_model.parameters(), lr=lr, momentum=0.9)
    steps, counter = len(loader), 0
    collect_at = {-(-(j + 1) * steps // per_epoch) - 1 for j in range(per_epoch)}
    for _ in range(epochs):
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(tu(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step in collect_at:
                counter += 1
                tu.update_wrapper(counter)
    tu.bn_update(loader, device="cpu")
    return tu.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 avoids OpenMP stalls on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    splits = data.load_digits()
    model = zoo.pretrained()
    loader = data.loader(splits.fit, batch_size=256)
    x = splits.test.tensors[0]
    fit = {"epochs": args.epochs, "lr": args.lr, "collect_per_epoch": 4, "progress": False}

    full = posthoc.wrap(model, method="swag", num_samples=SAMPLES).fit(loader, **fit)
    last = posthoc.wrap(model, method="swag", subset="last_layer", num_samples=SAMPLES).fit(loader, **fit)
    linear = posthoc.wrap(model, method="swag", subset=["classifier.1", "classifier.4"], num_samples=SAMPLES).fit(loader, **fit)
    tu = torch_uncertainty_swag(model, loader, args.lr, args.epochs, 4)

    def tu_predict() -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(tu(x).reshape(SAMPLES, len(x), -1), -1).mean(0)

    print(f"## predict, {len(x)} test digits, S={SAMPLES}, threads={torch.get_num_threads()}\n")
    print(HEADER.replace("cpu/wall |", "cpu/wall | cpu ratio |").replace("|---|---|---|---|", "|---|---|---|---|---|"))

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    print(ratio_row("plain forward", measure(forward, repeats=args.repeats), measure(forward, repeats=args.repeats)))
    print(paired("posthoc SWAG (all weights)", lambda: full.predict(x), forward, args.repeats))
    print(paired("torch-uncertainty SWAG (all weights)", tu_predict, forward, args.repeats))
    print(paired("posthoc SWAG last-layer", lambda: last.predict(x), forward, args.repeats))
    print(paired("posthoc SWAG, both Linear layers (prefix once)", lambda: linear.predict(x), forward, args.repeats))
    batched = linear.method.placement
    linear.method.placement = dataclasses.replace(batched, runner=None)  # no suffix runner: one pass per sample
    print(paired("posthoc SWAG, both Linear layers, one pass per sample", lambda: linear.predict(x), forward, args.repeats))
    linear.method.placement = batched

    method = full.method
    schedule = {"epochs": 1, "lr": args.lr, "collect_per_epoch": 4, "rank": 20, "momentum": 0.9, "weight_decay": 0.0,
                "include_pretrained": False, "progress": False}
    print(f"\n## one fine-tuning epoch ({len(loader)} steps of 256), ratio to one plain SGD epoch\n")
    print(HEADER.replace("plain forward", "plain epoch").replace("cpu/wall |", "cpu/wall | cpu ratio |").replace("|---|---|---|---|", "|---|---|---|---|---|"))
    epoch = lambda: plain_epoch(model, loader, args.lr)  # noqa: E731
    print(paired("SWAG epoch, 4 snapshots", lambda: method._fine_tune(loader, **schedule), epoch, args.repeats))
    collector = method.collector
    print(paired("4 x collector.update alone", lambda: [collector.update(model) for _ in range(4)], epoch, args.repeats))
    print(paired("last-layer SWAG epoch", lambda: last.method._fine_tune(loader, **schedule), epoch, args.repeats))


if __name__ == "__main__":
    main()
