"""Which bound keeps a held-out choice from costing on the next data: many random validation/test splits.

The selection step (``posthoc.engine.selection``) admits a candidate when an upper bound of its in-distribution NLL
excess over the plain model is within the tolerance, then takes the admissible one of lowest NLL on perturbed copies.
This benchmark replays that rule on Laplace's prior precision and MC dropout's rate (knobs whose candidates fit
nothing on held-out data, so each candidate's per-example scores on all 1,600 calibration + test digits are computed
once) over ``--draws`` random splits: 600 validation digits choose, a random 500 of the other 1,000 judge. For each
bound it prints how often the chosen candidate's test NLL exceeds the plain model's by more than the tolerance
``max(2 %, 0.005 nats)`` (the promise allows 5 %), and the chosen candidate's NLL on the perturbed copies of the
examples it did not choose on, as a ratio to the plain model's (lower: more gain under shift).

Bounds, each through the library's own :func:`~posthoc.engine.selection.excess_bound`: ``point`` (the mean excess
alone), ``mean 90 %`` (``m + z_0.9 se``, a bound on the true mean excess), ``new data 90 %`` (``m + z_0.9 se √2``:
the excess a new sample of the same size will show), ``mean 95 %``, ``new data 95 %``, and ``capped`` (the default:
new data 95 % with the gains below their 2.5 % quantile raised to it first).

Run: ``python benchmarks/bench_selection.py [--draws 300]`` (a few minutes); the table goes to
``benchmarks/results/choices.md`` by hand.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import posthoc  # noqa: E402
from posthoc.core.likelihood import Categorical  # noqa: E402
from posthoc.engine.held_out import HeldOut  # noqa: E402
from posthoc.engine.selection import CAPPED_GAINS, CONFIDENCE, NEW_SAMPLE, Scores, excess_bound  # noqa: E402
from posthoc.methods.laplace.prior_search import ladder  # noqa: E402
from posthoc.methods.mc_dropout.method import P_GRID, SELECTION_FACTOR  # noqa: E402
from posthoc.methods.mc_dropout.sites import with_rate  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

#: name -> (confidence, new_sample, capped_gains) of :func:`excess_bound`
BOUNDS = {
    "point": (0.5, math.inf, 0.0),
    "mean 90 %": (0.9, math.inf, 0.0),
    "new data 90 %": (0.9, 1.0, 0.0),
    "mean 95 %": (0.95, math.inf, 0.0),
    "new data 95 %": (0.95, 1.0, 0.0),
    "capped (default)": (CONFIDENCE, NEW_SAMPLE, CAPPED_GAINS),
}
VALIDATION, TEST = 600, 500


def candidate_scores(name: str, method: str, x: torch.Tensor, y: torch.Tensor) -> tuple[list[Scores], HeldOut]:
    """Every candidate's scores on all held-out digits and their perturbed copies, and the held-out data."""
    model = zoo.pretrained(name)
    splits = data.load_digits()
    pool = HeldOut.read(
        [(x[i : i + 256], y[i : i + 256]) for i in range(0, len(y), 256)],
        model=model,
        likelihood=Categorical(),
        device="cpu",
    )
    um = posthoc.wrap(model, method=method).fit(
        data.loader(splits.fit), [(x[:VALIDATION], y[:VALIDATION])], progress=False
    )
    with torch.no_grad():
        if method == "laplace":
            prepared = pool.prepared(um.method._prepare)
            return [um.method._scores(prepared, delta) for delta in ladder()], pool
        prepared = pool.prepared(lambda inputs: (inputs, um.method._head_features(inputs)))
        samples = SELECTION_FACTOR * um.method.num_samples
        found = [pool.plain]
        for rate in P_GRID:
            sites = with_rate(um.method._sites, rate)
            found.append(
                prepared.scores(
                    lambda inputs, generator: um.method._sampled(*inputs, samples, generator, sites)[0], device="cpu"
                )
            )
        return found, pool


def replay(scores: list[Scores], pool: HeldOut, draws: int) -> dict[str, tuple[float, float]]:
    """Per bound: the share of draws over the tolerance on the test half, and the mean perturbed-NLL ratio."""
    clean = torch.stack([s.clean for s in scores]) - pool.plain.clean
    shifted = torch.stack([s.shifted for s in scores])
    source = pool.layout.source
    generator = torch.Generator().manual_seed(123)
    failures = {name: 0 for name in BOUNDS}
    gains: dict[str, list[float]] = {name: [] for name in BOUNDS}
    count = pool.layout.count
    for _ in range(draws):
        order = torch.randperm(count, generator=generator)
        validation, rest = order[:VALIDATION], order[VALIDATION:]
        test = rest[torch.randperm(len(rest), generator=generator)[:TEST]]
        chosen_on = torch.zeros(count, dtype=torch.bool)
        chosen_on[validation] = True
        copies = chosen_on[source]
        reference = float(pool.plain.clean[test].mean())
        tolerance = max(0.02 * float(pool.plain.clean[validation].mean()), 0.005)
        zero = torch.zeros(VALIDATION, dtype=torch.float64)
        for name, (confidence, new_sample, capped) in BOUNDS.items():
            admissible = []
            for index in range(len(scores)):  # the walk: narrow to wide, stopping at the first refused candidate
                _, bound = excess_bound(
                    clean[index, validation], zero, confidence, new_sample=new_sample, capped_gains=capped
                )
                if not bound <= tolerance:
                    break
                admissible.append(index)
            admissible = admissible or [0]
            index = admissible[int(shifted[admissible][:, copies].mean(1).argmin())]
            failures[name] += float(clean[index, test].mean()) > max(0.02 * reference, 0.005)
            gains[name].append(float(shifted[index, ~copies].mean() / pool.plain.shifted[~copies].mean()))
    return {name: (failures[name] / draws, sum(gains[name]) / draws) for name in BOUNDS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=300)
    args = parser.parse_args(argv)
    splits = data.load_digits()
    x = torch.cat([splits.calibration.tensors[0], splits.test.tensors[0]])
    y = torch.cat([splits.calibration.tensors[1], splits.test.tensors[1]])
    print(
        f"`python benchmarks/bench_selection.py --draws {args.draws}`: share of random splits whose test half shows an "
        "in-distribution NLL excess over max(2 %, 0.005 nats) (the promise: at most 5 %), and the chosen candidate's "
        "NLL on the perturbed copies of the other examples / the plain model's.\n"
    )
    print("| checkpoint | choice | " + " | ".join(BOUNDS) + " |")
    print("|---|---|" + "---|" * len(BOUNDS))
    for name in ("digits_cnn", "digits_bn_cnn"):
        for method in ("laplace", "mc-dropout"):
            scores, pool = candidate_scores(name, method, x, y)
            found = replay(scores, pool, args.draws)
            cells = " | ".join(f"{100 * share:.1f} % · {gain:.3f}x" for share, gain in found.values())
            print(f"| {name} | {'prior precision' if method == 'laplace' else 'dropout rate'} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
