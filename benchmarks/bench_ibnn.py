"""iBNN cost and quality on the bundled digits CNN (run by hand: ``python benchmarks/bench_ibnn.py``).

Speed: ``predict`` with K=4 components x S=5 samples (one forward over a batch expanded 20x)
against one plain forward pass of the same batch, timed back to back in this process.
Quality: the demo configuration fine-tuned from the bundled checkpoint; fine-tuning time as a
multiple of one training epoch of the checkpoint (Adam, batch 64, timed here), then NLL / ECE
on the test digits rotated by 0-180 degrees next to the MAP model.

Example:
    $ python benchmarks/bench_ibnn.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import posthoc
from posthoc.demo import data, zoo
from posthoc.evaluation import metrics
from posthoc.methods.ibnn.method import ImplicitBNN

try:
    from timing import HEADER, measure, row
except ImportError:  # run from the repository root
    from benchmarks.timing import HEADER, measure, row

ANGLES = (0, 30, 60, 90, 120, 180)


def speed(model: torch.nn.Module, x: torch.Tensor, components: int, samples: int) -> None:
    um = posthoc.wrap(model, method="ibnn", components=components, num_samples=samples)
    um.method.fitted.fill_(True)
    with torch.no_grad():
        plain = measure(lambda: model(x))
        method = measure(lambda: um.predict(x))
    print(f"\n### predict, K={components}, S={samples} ({components * samples} samples), batch {len(x)}\n")
    print(HEADER)
    print(row("plain forward", plain, plain))
    print(row(f"ibnn predict (K={components}, S={samples})", method, plain))


def one_training_epoch(model: torch.nn.Module, splits: data.DigitsSplits) -> float:
    net = copy.deepcopy(model).train()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    start = time.perf_counter()
    for x, y in data.loader(splits.fit, batch_size=64, shuffle=True):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return time.perf_counter() - start


def quality(model: torch.nn.Module, splits: data.DigitsSplits) -> None:
    label, options = ImplicitBNN.demo_configs[0]
    fit_names = ImplicitBNN.fit_option_defaults()
    wrap_options = {k: v for k, v in options.items() if k not in fit_names}
    fit_options = {k: v for k, v in options.items() if k in fit_names}
    epoch = one_training_epoch(model, splits)
    torch.manual_seed(0)
    um = posthoc.wrap(model, method="ibnn", **wrap_options)
    start, cpu = time.perf_counter(), time.process_time()
    um.fit(data.loader(splits.fit, batch_size=64, shuffle=True), progress=False, **fit_options)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"\n### {label}: {options}\n")
    print(f"fine-tune {seconds:.1f} s (cpu/wall {cpu / seconds:.2f}) = {seconds / epoch:.1f}x one training epoch ({epoch:.1f} s)\n")
    print("| rotation | MAP NLL | iBNN NLL | MAP ECE | iBNN ECE | MAP acc | iBNN acc |")
    print("|---|---|---|---|---|---|---|")
    for angle in ANGLES:
        x, y = data.rotated(splits.test, angle).tensors
        with torch.no_grad():
            p_map = model(x).softmax(-1)
        p = um.predict(x, generator=torch.Generator().manual_seed(0)).probs
        print(f"| {angle} | {metrics.nll(p_map, y):.3f} | {metrics.nll(p, y):.3f} | {metrics.ece(p_map, y):.3f} | "
              f"{metrics.ece(p, y):.3f} | {metrics.accuracy(p_map, y):.3f} | {metrics.accuracy(p, y):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = data.load_digits()
    model = zoo.pretrained()
    speed(model, splits.test.tensors[0][:500], components=4, samples=5)
    if not args.skip_quality:
        quality(model, splits)


if __name__ == "__main__":
    main()
