"""MC dropout speed on the bundled digits CNN: ours (prefix once, samples batched) vs torch-uncertainty.

Times, back to back in one process, one plain forward pass over 1,000 test digits, then
``posthoc`` MC dropout (``predict``: the full Prediction, and ``log_predictive``: the predictive
alone) and torch-uncertainty's ``mc_dropout`` wrapper (which repeats the whole input S times,
``on_batch=True``, or loops over S forward passes, ``on_batch=False``) followed by the softmax
average, at equal S. Ratios are medians over repeats relative to the plain forward pass, in wall and in process CPU
time (more robust on a shared machine); torch-uncertainty runs once per setting (it is 15-100x
slower, so its noise does not matter for the comparison).

Run: ``python benchmarks/bench_mc_dropout.py [--samples 20 100] [--repeats 7] [--threads 2]``
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import posthoc  # noqa: E402
from posthoc.demo import data, zoo  # noqa: E402
from timing import HEADER, Timing, measure, row  # noqa: E402

#: largest activation torch-uncertainty's batched wrapper may allocate here (it repeats the input S times)
TU_BATCH_BYTES = 2 * 2**30


def _torch_uncertainty(model: torch.nn.Module, samples: int, on_batch: bool):
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="skip torch-uncertainty (slow)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = zoo.pretrained()
    x = data.load_digits().test.tensors[0]
    first_conv_bytes = 16 * 28 * 28 * 4 * x.shape[0]
    print(f"digits CNN, {x.shape[0]} test digits, {args.threads} threads, torch {torch.__version__}\n")
    print(HEADER.replace("cpu/wall |\n", "cpu/wall | cpu-time ratio |\n") + "---|")
    with torch.no_grad():
        for samples in args.samples:
            um = posthoc.wrap(model, method="mc-dropout", num_samples=samples)
            um.predict(x[:2])  # one-time site lookup and probe
            plain = measure(lambda: model(x), repeats=args.repeats)
            ours = measure(lambda: um.predict(x), repeats=args.repeats)
            ours_lp = measure(lambda: um.method.log_predictive(x), repeats=args.repeats)
            print(_row("plain forward", plain, plain))
            print(_row(f"posthoc mc-dropout predict, S={samples}", ours, plain))
            print(_row(f"posthoc mc-dropout log_predictive, S={samples}", ours_lp, plain))
            modes = [] if args.no_peer else [False] + ([True] if samples * first_conv_bytes <= TU_BATCH_BYTES else [])
            for on_batch in modes:
                theirs = _torch_uncertainty(model, samples, on_batch)
                timing = measure(lambda: theirs(x), repeats=1, warmup=0)  # 20-100 full passes each: one run
                print(_row(f"torch-uncertainty mc_dropout (on_batch={on_batch}), S={samples}", timing, plain))
    print("\nratio = median wall time / median wall time of one plain forward pass over the same digits")


if __name__ == "__main__":
    main()
