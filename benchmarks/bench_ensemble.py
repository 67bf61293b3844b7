"""Predict cost of a deep ensemble of ``M`` members of one architecture: vmapped against a loop.

Run by hand (not by pytest)::

    python benchmarks/bench_ensemble.py                         # both digits CNNs, M = 2, 5, 10
    python benchmarks/bench_ensemble.py --archs digits_cnn --members 5 --threads 2

For each architecture and ``M``, back to back in one process on a batch of 256 test digits (CPU):

- one plain forward of one member (the reference, ratio 1);
- ``M`` plain forwards one after the other (what any loop costs at least);
- ``posthoc.wrap(members, batched=True).predict(x)``: the members' parameters batched and the forward
  vmapped (the default on CUDA);
- ``posthoc.wrap(members, batched=False).predict(x)``: the same predictive as a loop over members (the
  default on the CPU, where it measured faster).

Target (issue 16): the vmapped predict at most ``0.8 x M`` plain forwards. Medians of repeats, CPU
time beside wall time (``benchmarks/timing.py``: a cpu/wall far below the thread count was contended
and must be re-run). Members are the bundled checkpoint with seeded weight noise (the cost does not
depend on the values).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import HEADER, measure, row  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

warnings.filterwarnings("ignore")
TARGET = 0.8  # vmapped predict <= TARGET x M plain forwards
BATCH = 256


def members_of(name: str, count: int) -> list[nn.Module]:
    """``count`` members of the bundled architecture ``name``: the checkpoint and seeded perturbations of it."""
    base = zoo.pretrained(name)
    members = [base]
    for seed in range(1, count):
        member = copy.deepcopy(base)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in member.parameters():
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
        members.append(member.eval())
    return members


def bench(name: str, count: int, x: torch.Tensor, repeats: int) -> list[str]:
    """The Markdown rows for ``count`` members of ``name`` (see module docs)."""
    members = members_of(name, count)
    batched, loop = posthoc.wrap(members, batched=True), posthoc.wrap(members, batched=False)
    assert batched.method.vmapped and not loop.method.vmapped
    torch.testing.assert_close(batched.predict(x).probs, loop.predict(x).probs, atol=1e-5, rtol=0)
    with torch.no_grad():
        plain = measure(lambda: members[0](x), repeats=repeats)
        forwards = measure(lambda: [member(x) for member in members], repeats=repeats)
    vmapped = measure(lambda: batched.predict(x), repeats=repeats)
    looped = measure(lambda: loop.predict(x), repeats=repeats)
    verdict = "meets" if vmapped.wall <= TARGET * count * plain.wall else "misses"
    timed = {
        "one plain forward": plain,
        f"{count} plain forwards": forwards,
        f"ensemble predict, vmapped ({verdict} <= {TARGET * count:.1f}x)": vmapped,
        "ensemble predict, loop": looped,
    }
    # the CPU seconds' ratio beside the wall one: on a contended machine it is the steadier of the two
    return [
        row(f"{name} M={count}: {what}", timing, plain) + f" {timing.cpu / plain.cpu:.2f}x |"
        for what, timing in timed.items()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--archs", nargs="+", default=["digits_cnn", "digits_bn_cnn"], choices=sorted(zoo.ARCHITECTURES)
    )
    parser.add_argument("--members", type=int, nargs="+", default=[2, 5, 10])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = data.load_digits().test.tensors[0][:BATCH]
    print(f"batch {BATCH}, CPU, {args.threads} thread(s), torch {torch.__version__}, medians of {args.repeats}\n")
    head, rule = HEADER.split("\n")
    print(f"{head} CPU s ratio to plain |\n{rule}---|")
    for name in args.archs:
        for count in args.members:
            for line in bench(name, count, x, args.repeats):
                print(line, flush=True)


if __name__ == "__main__":
    main()
