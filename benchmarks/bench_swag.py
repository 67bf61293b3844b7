"""SWAG on the bundled digits models: quality against the plain model and torch-uncertainty's SWAG,
an ablation of every difference between the two, and the cost of predict and fit.

``--part quality`` (issue 15): NLL and ECE on the test digits rotated 0/45/90 degrees, for both
bundled models (``digits_cnn``, ``digits_bn_cnn``), fitted with the quality protocol
(``fit(data.loader(fit, 64, shuffle=True), data.loader(calibration))``): the plain model, SWAG's
defaults (full network and last layer), the previous default schedule, and SWAG and
torch-uncertainty's SWAG on torch-uncertainty's fine-tune (10 epochs, SGD lr 0.01, momentum 0.9,
weight decay 5e-4, scale 0.5, one snapshot per epoch, 20 samples); fit CPU seconds and the predict
CPU time as a ratio to a plain forward.

``--part ablation``: one fine-tuning trajectory of that schedule on ``digits_cnn``, then each
difference between the two SWAGs switched one at a time (snapshots per epoch and how many are
kept, the low-rank divisor ``sqrt(K - 1)`` vs torch-uncertainty's ``sqrt(max_num_models - 1)``, its
variance floor 1e-6, BatchNorm statistics per sample over 4 batches, the whole loader or once at the
mean, the fine-tuning's data order), the samples predicting in train mode, and the SWA mean.

What it found: torch-uncertainty's samples are kept in a plain list, so ``tu.eval()`` leaves them in
train mode; they predict with BatchNorm normalising by the *test batch's* statistics (and dropout
on). On rotated digits that batch adaptation, not the posterior, is its whole advantage: with its
samples in eval mode it matches posthoc on the same fine-tune (the quality table shows both rows),
and predictions in train mode depend on which examples share the batch.

``--part speed``: predict (S=20) vs a forward pass and torch-uncertainty's SWAG, last-layer SWAG,
SWAG over the two Linear layers (prefix once, and one pass per sample), a fine-tuning epoch.

Run by hand::

    python benchmarks/bench_swag.py --threads 1 --part quality
    python benchmarks/bench_swag.py --threads 1 --part ablation
    python benchmarks/bench_swag.py --threads 1 --part speed     # add --repeats 7 on a quiet machine
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import HEADER, Timing, measure, row
from torch.func import functional_call

import posthoc
from posthoc.engine.bn_refresh import batchnorm_statistics
from posthoc.evaluation import metrics
from posthoc.methods.swag.base import collect_steps
from posthoc_apps.demo import data, zoo

SAMPLES = 20
ANGLES = (0, 45, 90)
MODELS = ("digits_cnn", "digits_bn_cnn")
#: torch-uncertainty's fine-tune of issue 15
TU_SCHEDULE = {"epochs": 10, "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4, "collect_per_epoch": 1}


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


def torch_uncertainty_swag(
    model: torch.nn.Module, loader, lr: float, epochs: int, per_epoch: int, weight_decay: float = 0.0
):
    """torch-uncertainty's SWAG on the same fine-tuning schedule (snapshots at the same steps)."""
    from torch_uncertainty.methods.swag import SWAG as TUSWAG

    tu = TUSWAG(
        copy.deepcopy(model), cycle_start=0, cycle_length=1, scale=0.5, max_num_models=20, num_estimators=SAMPLES
    )
    tu.train()
    optimizer = torch.optim.SGD(tu.core_model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    steps, counter = len(loader), 0
    collect_at = collect_steps(steps, per_epoch)
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


# ----------------------------------------------------------------------------- quality
def scores(
    probs_at: Callable[[torch.Tensor], torch.Tensor], tests: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> dict[int, tuple[float, float]]:
    """``{angle: (NLL, ECE)}`` of the predictive ``probs_at(x)`` on each rotated test set."""
    out = {}
    for angle, (x, y) in tests.items():
        with torch.no_grad():
            probs = probs_at(x)
        out[angle] = (metrics.nll(probs, y), metrics.ece(probs, y))
    return out


def quality_row(
    name: str, result: dict[int, tuple[float, float]], fit_cpu: float, predict_ratio: float, plain: dict | None
) -> str:
    nll = " | ".join(
        f"{result[a][0]:.3f}" + ("" if plain is None else ("*" if result[a][0] < plain[a][0] else "")) for a in ANGLES
    )
    ece = " | ".join(f"{100 * result[a][1]:.2f}" for a in ANGLES)
    return f"| {name} | {nll} | {ece} | {fit_cpu:.1f} | {predict_ratio:.1f}x |"


def cpu_seconds(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def quality(model_name: str) -> None:
    """The quality table of one bundled model (see module docs)."""
    splits = data.load_digits()
    model = zoo.pretrained(model_name)
    tests = {a: data.rotated(splits.test, a).tensors for a in ANGLES}
    x_test = tests[0][0]

    def fit_loader():
        return data.loader(splits.fit, 64, shuffle=True, seed=0)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(x_test)

    base_cpu = measure(forward, repeats=3).cpu
    plain = scores(lambda x: torch.softmax(model(x), -1), tests)
    rows = [quality_row("plain model", plain, 0.0, 1.0, None)]
    fits = {
        "SWAG default (full network, scale on val)": ({}, {}),
        "SWAG default, last layer": ({"subset": "last_layer"}, {}),
        "SWAG previous default (1 epoch, lr 1e-3, scale 0.5)": ({"scale": 0.5}, {"epochs": 1, "lr": 1e-3}),
        "SWAG on torch-uncertainty's fine-tune": ({"scale": 0.5}, TU_SCHEDULE),
    }
    for name, (options, schedule) in fits.items():
        torch.manual_seed(0)
        um, fit_cpu = cpu_seconds(
            lambda: posthoc.wrap(model, method="swag", num_samples=SAMPLES, **options).fit(
                fit_loader(), data.loader(splits.calibration), progress=False, **schedule
            )
        )
        predict_cpu = measure(lambda: um.predict(x_test), repeats=3).cpu
        card = um.method.summary()
        label = f"{name} [scale {card['scale']:g}, lr {card['lr']:.2g}, {card['snapshots']} snapshots]"
        rows.append(
            quality_row(label, scores(lambda x: um.predict(x).probs, tests), fit_cpu, predict_cpu / base_cpu, plain)
        )
    torch.manual_seed(0)
    schedule = {k: TU_SCHEDULE[k] for k in ("lr", "epochs", "weight_decay")}
    tu, fit_cpu = cpu_seconds(lambda: torch_uncertainty_swag(model, fit_loader(), per_epoch=1, **schedule))

    def tu_probs(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(tu(x).reshape(SAMPLES, len(x), -1), -1).mean(0)

    predict_cpu = measure(lambda: tu_probs(x_test), repeats=3).cpu
    rows.append(
        quality_row(
            "torch-uncertainty SWAG, same fine-tune", scores(tu_probs, tests), fit_cpu, predict_cpu / base_cpu, plain
        )
    )
    for (
        sample
    ) in tu.samples:  # a plain list, so tu.eval() left them in train mode: BatchNorm on the test batch, dropout on
        sample.eval()
    rows.append(
        quality_row(
            "torch-uncertainty SWAG, its samples in eval mode",
            scores(tu_probs, tests),
            fit_cpu,
            predict_cpu / base_cpu,
            plain,
        )
    )
    print(
        f"\n## {model_name}: NLL and ECE (%) on test digits rotated 0/45/90 deg, S={SAMPLES} (* lower NLL than plain)\n"
    )
    print("| model | NLL 0 | NLL 45 | NLL 90 | ECE 0 | ECE 45 | ECE 90 | fit CPU s | predict CPU / forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


# ----------------------------------------------------------------------------- ablation
def fine_tune_snapshots(
    model: torch.nn.Module, *, seed: int, per_epoch: int = 4
) -> tuple[list[torch.Tensor], list[bool]]:
    """Fine-tune a copy on torch-uncertainty's schedule; snapshots (flat float64) ``per_epoch`` times an epoch,
    each flagged when it is the epoch's last step (torch-uncertainty's one snapshot per epoch)."""
    loader = data.loader(data.load_digits().fit, 64, shuffle=True, seed=seed)
    work = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(
        work.parameters(), lr=TU_SCHEDULE["lr"], momentum=0.9, weight_decay=TU_SCHEDULE["weight_decay"]
    )
    at = collect_steps(len(loader), per_epoch)
    snapshots, epoch_ends = [], []
    for _ in range(TU_SCHEDULE["epochs"]):
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(work(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step in at:
                snapshots.append(torch.cat([p.detach().reshape(-1).double() for p in work.parameters()]))
                epoch_ends.append(step == len(loader) - 1)
    return snapshots, epoch_ends


def swag_moments(snapshots: list[torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, diagonal variance and the last ``rank`` deviations (from the running mean), as both SWAGs keep them."""
    mean, square = torch.zeros_like(snapshots[0]), torch.zeros_like(snapshots[0])
    deviations = []
    for count, theta in enumerate(snapshots, 1):
        mean = mean + (theta - mean) / count
        square = square + (theta * theta - square) / count
        deviations.append(theta - mean)
    return mean, (square - mean**2).clamp_min(0), torch.stack(deviations[-rank:])


def bn_state(model: torch.nn.Module, params: dict, how: str) -> dict:
    splits = data.load_digits()
    if how == "4 batches (posthoc)":
        batches = [x for _, (x, _) in zip(range(4), data.loader(splits.fit, 64, shuffle=True, seed=0))]
        return batchnorm_statistics(model, batches, parameters=params)
    work = copy.deepcopy(model)  # torch's swa_utils.update_bn over the whole loader (torch-uncertainty)
    work.load_state_dict({**work.state_dict(), **params})
    torch.optim.swa_utils.update_bn(data.loader(splits.fit, 64, shuffle=True, seed=0), work)
    return {k: v for k, v in work.state_dict().items() if "running" in k}


def ablated(
    model: torch.nn.Module,
    snapshots: list[torch.Tensor],
    tests: dict,
    *,
    rank: int = 20,
    divisor: str = "K - 1",
    variance_floor: float = 0.0,
    bn: str = "4 batches (posthoc)",
    bn_once: bool = False,
    scale: float = 0.5,
    low_rank: bool = True,
    train_mode: bool = False,
) -> dict:
    """Scores of SWAG built from ``snapshots`` with one choice changed (defaults: posthoc's)."""
    mean, variance, deviations = swag_moments(snapshots, rank)
    std, held = variance.clamp_min(variance_floor).sqrt(), deviations.shape[0]
    norm = math.sqrt((held if divisor == "K - 1" else rank) - 1)
    shapes = [(n, p.shape, p.numel()) for n, p in model.named_parameters()]

    def unflatten(flat: torch.Tensor) -> dict:
        return {
            n: part.reshape(shape).float() for (n, shape, _), part in zip(shapes, flat.split([k for *_, k in shapes]))
        }

    generator = torch.Generator().manual_seed(0)
    once = bn_state(model, unflatten(mean), bn) if bn_once else None
    count = 1 if scale == 0 else SAMPLES
    members = []
    for _ in range(count):
        theta = std * torch.randn(mean.shape, generator=generator, dtype=torch.float64)
        if low_rank:
            theta = theta + torch.randn(held, generator=generator, dtype=torch.float64) @ deviations / norm
        params = unflatten(mean + math.sqrt(scale) * theta)
        members.append({**params, **(once if bn_once else bn_state(model, params, bn))})

    def probs(x: torch.Tensor) -> torch.Tensor:
        model.train(train_mode)  # train mode: BatchNorm normalises with the test batch's own statistics, dropout on
        try:
            return torch.stack(
                [torch.softmax(functional_call(model, {k: v.clone() for k, v in m.items()}, (x,)), -1) for m in members]
            ).mean(0)
        finally:
            model.eval()

    return scores(probs, tests)


def ablation() -> None:
    """Each difference between posthoc's and torch-uncertainty's SWAG, one at a time, on one trajectory."""
    splits = data.load_digits()
    model = zoo.pretrained("digits_cnn")
    tests = {a: data.rotated(splits.test, a).tensors for a in ANGLES}
    torch.manual_seed(0)
    snapshots, ends = fine_tune_snapshots(model, seed=0)
    per_epoch = [s for s, end in zip(snapshots, ends) if end]
    torch.manual_seed(0)
    other_order, _ = fine_tune_snapshots(model, seed=1)
    plain = scores(lambda x: torch.softmax(model(x), -1), tests)
    variants = {
        "posthoc: 4 snapshots/epoch, rank 20, /sqrt(K-1), BN per sample on 4 batches": (snapshots, {}),
        "1 snapshot/epoch (10 kept, as torch-uncertainty)": (per_epoch, {}),
        "4 snapshots/epoch, rank 10": (snapshots, {"rank": 10}),
        "/sqrt(max_num_models - 1) = /sqrt(19), 1 snapshot/epoch": (per_epoch, {"divisor": "max"}),
        "variance floor 1e-6": (snapshots, {"variance_floor": 1e-6}),
        "BN per sample, update_bn on the whole loader": (snapshots, {"bn": "update_bn"}),
        "BN once, at the SWA mean": (snapshots, {"bn_once": True}),
        "diagonal only (no low-rank part)": (snapshots, {"low_rank": False}),
        "fine-tune data order: another seed": (other_order, {}),
        "torch-uncertainty's sampling choices together": (
            per_epoch,
            {"divisor": "max", "variance_floor": 1e-6, "bn": "update_bn"},
        ),
        "samples predict in train mode (torch-uncertainty's samples stay so)": (snapshots, {"train_mode": True}),
        "SWA mean (scale 0)": (snapshots, {"scale": 0.0}),
    }
    print(
        "\n## digits_cnn, torch-uncertainty's fine-tune (10 epochs, lr 0.01, wd 5e-4), scale 0.5, S=20: one difference at a time\n"
    )
    print("| variant | NLL 0 | NLL 45 | NLL 90 | ECE 0 | ECE 45 | ECE 90 | sampling CPU s | - |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(quality_row("plain model", plain, 0.0, 1.0, None), flush=True)
    for name, (chosen, options) in variants.items():
        result, cpu = cpu_seconds(lambda: ablated(model, chosen, tests, **options))
        print(quality_row(name, result, cpu, math.nan, plain), flush=True)


# ----------------------------------------------------------------------------- speed
def speed(args: argparse.Namespace) -> None:
    """Predict and fine-tuning cost on ``digits_cnn`` (fixed schedule: ``--epochs``, ``--lr``)."""
    torch.manual_seed(0)
    splits = data.load_digits()
    model = zoo.pretrained()
    loader = data.loader(splits.fit, batch_size=256)
    x = splits.test.tensors[0]
    fit = {"epochs": args.epochs, "lr": args.lr, "collect_per_epoch": 4, "progress": False}

    full = posthoc.wrap(model, method="swag", num_samples=SAMPLES, scale=0.5).fit(loader, **fit)
    last = posthoc.wrap(model, method="swag", subset="last_layer", num_samples=SAMPLES, scale=0.5).fit(loader, **fit)
    linear = posthoc.wrap(
        model, method="swag", subset=["classifier.1", "classifier.4"], num_samples=SAMPLES, scale=0.5
    ).fit(loader, **fit)
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
    print(
        paired(
            "posthoc SWAG, both Linear layers, one pass per sample", lambda: linear.predict(x), forward, args.repeats
        )
    )
    linear.method.placement = batched

    method = full.method
    schedule = {
        "epochs": 1,
        "lr": args.lr,
        "collect_per_epoch": 4,
        "rank": 20,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "include_pretrained": False,
        "progress": False,
    }
    print(f"\n## one fine-tuning epoch ({len(loader)} steps of 256), ratio to one plain SGD epoch\n")
    print(
        HEADER.replace("plain forward", "plain epoch")
        .replace("cpu/wall |", "cpu/wall | cpu ratio |")
        .replace("|---|---|---|---|", "|---|---|---|---|---|")
    )
    epoch = lambda: plain_epoch(model, loader, args.lr)  # noqa: E731
    print(paired("SWAG epoch, 4 snapshots", lambda: method._fine_tune(loader, **schedule), epoch, args.repeats))
    collector = method.collector
    print(
        paired("4 x collector.update alone", lambda: [collector.update(model) for _ in range(4)], epoch, args.repeats)
    )
    print(paired("last-layer SWAG epoch", lambda: last.method._fine_tune(loader, **schedule), epoch, args.repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("quality", "ablation", "speed", "all"), default="all")
    parser.add_argument("--models", default=",".join(MODELS), help="for --part quality")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="for --part speed")
    parser.add_argument("--lr", type=float, default=0.05, help="for --part speed")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 avoids OpenMP stalls on a busy machine)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("quality", "all"):
        for name in args.models.split(","):
            quality(name)
    if args.part in ("ablation", "all"):
        ablation()
    if args.part in ("speed", "all"):
        speed(args)


if __name__ == "__main__":
    main()
