"""What shift-aware fitting costs: each method's held-out choice with ``shift="auto"`` against ``shift=None``.

The target: a shift-aware fit costs at most ``1 + len(STRENGTHS)`` times the clean-only held-out
choice (each candidate is scored on the clean batches and on one perturbed copy per strength).
A method's *held-out cost* is its fit time minus the same fit with the knob fixed (nothing chosen
on held-out data), so a fine-tune both share cancels:

- ``base``: the knob fixed (``prior_precision=1``, ``p=0.1``, ``scale=1``; ``temperature`` has no
  fit without held-out data, so its base is 0);
- ``clean``: chosen on the calibration split with ``shift=None``;
- ``aware``: chosen with ``shift="auto"`` (the default); the graded-strength cache is cleared before
  every fit, so each pays the one-off grading as a user's first fit does;
- ``graded``: the same with the strengths already graded for this model (a second method fitted on
  the same checkpoint, or the next link of a chain, reuses them): the cost of scoring the candidates
  on the perturbed copies alone.

Medians of ``--repeats`` fits in one process, wall and process CPU time; the ratio is
``(aware - base) / (clean - base)`` on CPU time (on a shared machine the CPU ratio is the one to read).

Run: ``python benchmarks/bench_shift_fit_cost.py [--threads 1] [--repeats 3] [--methods ...]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import Timing, measure  # noqa: E402

import posthoc  # noqa: E402
from posthoc.engine import held_out  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

ARCHITECTURES = ("digits_cnn", "digits_bn_cnn")
#: method -> (options with the knob fixed, options with it chosen on held-out data); None: no fixed fit
SETTINGS = {
    "temperature": (None, {}),
    "laplace": ({"prior_precision": 1.0}, {}),
    "mc-dropout": ({"p": 0.1}, {}),
    "ivon": ({"scale": 1.0, "layers": "head"}, {"layers": "head"}),
    "ibnn": ({"scale": 1.0}, {}),
    "swag": ({"scale": 0.5, "subset": "last_layer"}, {"subset": "last_layer"}),
}
DEFAULT_METHODS = ("temperature", "laplace", "mc-dropout", "ivon")


def fit_time(
    model, method: str, options: dict | None, fit_loader, val_loader, shift, repeats: int, regrade: bool = True
) -> Timing:
    """Median wall and CPU seconds of ``wrap(...).fit`` (zero when ``options`` is None: no such fit)."""
    if options is None:
        return Timing(0.0, 0.0)

    def fit() -> None:
        if regrade:
            held_out._GRADED.clear()  # every fit grades its strengths, as a user's first fit does
        um = posthoc.wrap(model, method=method, **options)
        um.fit(fit_loader, val_loader, progress=False, **({} if shift == "none" else {"shift": shift}))

    return measure(fit, repeats=repeats, warmup=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=sorted(SETTINGS), default=list(DEFAULT_METHODS))
    parser.add_argument("--archs", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    splits = data.load_digits()
    fit_loader = data.loader(splits.fit, 256)
    val_loader = data.loader(splits.calibration, 256)
    target = 1 + len(held_out.STRENGTHS)
    print(
        f"Made by `python benchmarks/bench_shift_fit_cost.py --threads {args.threads} --repeats {args.repeats} "
        f"--methods {' '.join(args.methods)}`; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    print(
        f"Target: held-out cost with shift='auto' <= {target}x the clean-only one (1 + {len(held_out.STRENGTHS)} strengths)."
    )
    for name in args.archs:
        model = zoo.pretrained(name)
        print(f"\n### {name}: fit seconds (median of {args.repeats}; wall / CPU)\n")
        print(
            "| method | knob fixed | chosen, shift=None | chosen, shift='auto' | held-out cost ×clean (CPU) | "
            "target | strengths already graded | ×clean (CPU) | cpu/wall |\n|---|---|---|---|---|---|---|---|---|"
        )
        for method in args.methods:
            fixed, chosen = SETTINGS[method]
            base = fit_time(model, method, fixed, fit_loader, val_loader, "none", args.repeats)
            clean = fit_time(model, method, chosen, fit_loader, val_loader, None, args.repeats)
            aware = fit_time(model, method, chosen, fit_loader, val_loader, "auto", args.repeats)
            graded = fit_time(model, method, chosen, fit_loader, val_loader, "auto", args.repeats, regrade=False)
            ratio = (aware.cpu - base.cpu) / max(clean.cpu - base.cpu, 1e-9)
            graded_ratio = (graded.cpu - base.cpu) / max(clean.cpu - base.cpu, 1e-9)
            contended = any(t.contended for t in (clean, aware) if t.wall > 0)
            verdict = "meets" if ratio <= target else f"misses by {ratio - target:.1f}x"
            print(
                f"| {method} | {base.wall:.2f} / {base.cpu:.2f} | {clean.wall:.2f} / {clean.cpu:.2f} | "
                f"{aware.wall:.2f} / {aware.cpu:.2f} | {ratio:.1f}x | {verdict} | "
                f"{graded.wall:.2f} / {graded.cpu:.2f} | {graded_ratio:.1f}x | "
                f"{min(t.cpu_per_wall for t in (clean, aware)):.2f}{' (contended: re-run)' if contended else ''} |"
            )


if __name__ == "__main__":
    main()
