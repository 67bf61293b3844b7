"""MC dropout speed: head dropout (S masks shared across the batch) against one plain forward pass.

Times, back to back in one process, a plain forward pass and ``posthoc`` MC dropout over the
head (``predict``: the full Prediction, and ``log_predictive``: the predictive alone) on

* the bundled digits CNN (its own dropout feeds the head) over 1,000 test digits, and
* a tiny CNN (~43k parameters, 8x8 inputs, dropout inserted before its head) over 500 inputs,

the cost of choosing the rate at fit (``p="auto"``, as ``p=None`` does given a ``val_loader``: the plain model and
every rate of ``P_GRID`` with ``SELECTION_FACTOR * num_samples``
masks over the 600 calibration digits) against one plain forward pass over them, on both bundled
digits models (own dropout; dropout inserted at the head),
and, on the digits CNN, torch-uncertainty's ``mc_dropout`` wrapper (which repeats the whole input S
times, ``on_batch=True``, or loops over S forward passes, ``on_batch=False``) followed by the
softmax average, at equal S. Ratios are medians over repeats relative to the plain forward pass, in
wall and in process CPU time (more robust on a shared machine); torch-uncertainty runs once per
setting (it is 15-100x slower, so its noise does not matter for the comparison). Target: head MC
dropout at S=100 within 1.2x of the plain forward pass.

Run: ``python benchmarks/bench_mc_dropout.py [--samples 20 100] [--repeats 9] [--threads 1] [--no-peer] [--no-fit]``
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import HEADER, Timing, measure, row  # noqa: E402

import posthoc  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

#: largest activation torch-uncertainty's batched wrapper may allocate here (it repeats the input S times)
TU_BATCH_BYTES = 2 * 2**30


def tiny_cnn() -> nn.Module:
    """A few tens of thousands of parameters on 8x8 inputs (43,178), no dropout of its own."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).eval()


def _torch_uncertainty(model: nn.Module, samples: int, on_batch: bool):
    try:
        from torch_uncertainty.methods import mc_dropout
    except ImportError:  # older releases
        from torch_uncertainty.models import mc_dropout
    wrapped = mc_dropout(copy.deepcopy(model), num_estimators=samples, last_layer=False, on_batch=on_batch)
    wrapped.eval()  # their eval() keeps the dropout modules in train mode

    def predict(x: torch.Tensor) -> torch.Tensor:
        logits = wrapped(x).reshape(samples, x.shape[0], -1)
        return torch.softmax(logits, -1).mean(0)

    return predict


def _row(name: str, timing: Timing, reference: Timing) -> str:
    return f"{row(name, timing, reference)} {timing.cpu / reference.cpu:.2f}x |"


def _compare(label: str, model: nn.Module, x: torch.Tensor, args: argparse.Namespace, options: dict) -> None:
    print(f"\n{label}, {x.shape[0]} inputs of {tuple(x.shape[1:])}\n")
    print(HEADER.replace("cpu/wall |\n", "cpu/wall | cpu-time ratio |\n") + "---|")
    with torch.no_grad():
        for samples in args.samples:
            um = posthoc.wrap(model, method="mc-dropout", num_samples=samples, masks="shared", **options)
            um.predict(x[:2])  # the first call checks that the site is the head's input (once)
            plain = measure(lambda: model(x), repeats=args.repeats)
            ours = measure(lambda: um.predict(x), repeats=args.repeats)
            ours_lp = measure(lambda: um.method.log_predictive(x), repeats=args.repeats)
            print(_row("plain forward", plain, plain))
            print(_row(f"posthoc mc-dropout predict, S={samples}", ours, plain))
            print(_row(f"posthoc mc-dropout log_predictive, S={samples}", ours_lp, plain))
            if args.no_peer or label != "digits CNN":
                continue
            first_conv_bytes = 16 * 28 * 28 * 4 * x.shape[0]
            for on_batch in [False] + ([True] if samples * first_conv_bytes <= TU_BATCH_BYTES else []):
                theirs = _torch_uncertainty(model, samples, on_batch)
                timing = measure(lambda: theirs(x), repeats=1, warmup=0)  # 20-100 full passes each: one run
                print(_row(f"torch-uncertainty mc_dropout (on_batch={on_batch}), S={samples}", timing, plain))


def _fit_cost(args: argparse.Namespace) -> None:
    """The rate choice at fit, timed against a plain forward pass over the validation digits."""
    validation = data.load_digits().calibration
    loader = data.loader(validation)
    print(f"\nchoosing the rate at fit (p='auto'), {len(validation)} validation digits\n")
    print(HEADER.replace("cpu/wall |\n", "cpu/wall | cpu-time ratio |\n") + "---|")
    for name in ("digits_cnn", "digits_bn_cnn"):
        model = zoo.pretrained(name)
        with torch.no_grad():
            plain = measure(lambda: [model(x) for x, _ in loader], repeats=args.repeats)
        fit = measure(
            lambda: posthoc.wrap(model, method="mc-dropout", p="auto").fit(None, loader, progress=False),
            repeats=3,
            warmup=1,
        )
        print(_row(f"{name}: plain forward", plain, plain))
        print(_row(f"{name}: mc-dropout fit (rate chosen)", fit, plain))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="skip torch-uncertainty (slow)")
    parser.add_argument("--no-fit", action="store_true", help="skip the cost of choosing the rate at fit")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, torch {torch.__version__}")
    _compare("digits CNN", zoo.pretrained(), data.load_digits().test.tensors[0], args, {})
    tiny_inputs = torch.randn(500, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    _compare("tiny CNN", tiny_cnn(), tiny_inputs, args, {"where": "head"})
    if not args.no_fit:
        _fit_cost(args)
    print("\nratio = median wall (CPU) time / median wall (CPU) time of one plain forward pass over the same inputs")


if __name__ == "__main__":
    main()
