"""Both error rates of the selection step, per checkpoint and per method, over random validation/test re-draws.

A held-out choice makes two errors (``docs/selection.md``):

- **worse**: the chosen candidate's NLL on the draw's test set exceeds the plain model's by more than
  ``max(2 %, 0.005 nats)``. Target: at most 5 % of draws, for ``auto`` and for every method's default.
- **timid**: in a draw where some candidate gains at least 20 % of the plain model's test NLL on its own, ``auto``
  takes less than 80 % of the best candidate's gain. Target: at most 20 % of those draws. For ``temperature``, the
  reference is the clean maximum-likelihood temperature that ``posthoc.calibrate(..., tolerance=math.inf)``,
  netcal and torch-uncertainty fit on the same validation logits.

Checkpoints: the two bundled digits CNNs (``posthoc_apps.demo.zoo``), overfit MLPs on three of scikit-learn's bundled
tabular sets (``posthoc_apps.demo.tabular``: breast cancer, the 8x8 digits as features, wine; five training seeds each), a
timm ``resnet10t`` trained on the bundled digits, and an MLP regressor on Auto MPG (``posthoc_apps.demo.data``).
Every method's chain is fitted once on the training data; each draw splits the held-out pool at random into a
validation set, on which every held-out choice is made again (``um.choose``: the same code path as ``fit``), and a
test set. Under shift, on the image checkpoints, each draw also scores every candidate on the test set corrupted by
the evaluation kinds (``posthoc.shift.EVALUATION_KINDS`` at severities 2 and 4: kinds no fit-time choice sees):
``auto``'s NLL ratio to the plain model's beside the best single candidate's, and the Spearman correlation between
the fit-time shift criterion the selection ranks by (``shifted_ratio`` in the record) and the ratio under the
evaluation kinds, over the candidates.

``--rule old`` replaces the bound by the one before this rule (the paired normal bound at 95 % on new data with the
largest 2.5 % of gains capped), ``--rule point`` by the mean excess alone: the first must come out timid, the second
worse (``tests/bench/test_selection_errors.py`` and ``tests/engine/test_never_worse.py`` check the same on fewer draws).

Run: ``python benchmarks/selection_errors.py [--draws 20] [--seeds 2] [--only breast_cancer digits_bn_cnn ...]
[--rule new] [--json out.json] [--docs-table]`` (an hour or two on 2 cores for everything; ``--from-json`` renders
saved runs); the tables go to ``benchmarks/results/selection_errors.md``, and ``--docs-table`` writes the one of
``docs/which-method.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import torch
from scipy import stats
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import posthoc  # noqa: E402
import posthoc.engine.selection as selection  # noqa: E402
from posthoc.core.likelihood import Categorical, Gaussian  # noqa: E402
from posthoc.core.modules import eval_mode  # noqa: E402
from posthoc.engine.held_out import HeldOut  # noqa: E402
from posthoc.methods.auto.method import default_candidates  # noqa: E402
from posthoc.methods.calibration.temperature import TemperatureCalibrator  # noqa: E402
from posthoc.shift import EVALUATION_KINDS, corrupt_images  # noqa: E402
from posthoc_apps.demo import data, regression, tabular, zoo  # noqa: E402

#: severities of the evaluation kinds scored under shift
SHIFT_SEVERITIES = (2, 4)
#: a gain this large (share of the plain test NLL) makes a draw count for the timid rate
PLAIN_GAIN = 0.2
#: the share of the best gain a choice must take
TAKEN = 0.8
#: the targets: worse at most this share of draws, timid at most that share of the counted draws
WORSE_TARGET, TIMID_TARGET = 0.05, 0.2


@dataclass
class Checkpoint:
    """One checkpoint of the suite: the model, its training loader, the held-out pool and a draw's sizes."""

    name: str
    model: nn.Module
    train: object
    pool: tuple[Tensor, Tensor]
    validation: int
    test: int
    regression: bool = False
    #: pixel normalisation of image inputs, for the evaluation kinds (``None``: no image shift)
    normalization: tuple[float, float] | None = None
    seed: int = 0


@dataclass
class Tally:
    """What one method did over the draws of one checkpoint."""

    worse: int = 0
    draws: int = 0
    counted: int = 0  # draws with a plain gain (>= 20 %) on offer
    timid: int = 0
    shares: list[float] = field(default_factory=list)
    ratios: list[tuple[float, float]] = field(default_factory=list)  # (test NLL, plain test NLL) per draw

    @property
    def ratio(self) -> float:
        """The mean test NLL over the draws as a ratio to the plain model's (a ratio of means: a draw whose plain NLL
        is near zero does not dominate it)."""
        return sum(v for v, _ in self.ratios) / max(sum(p for _, p in self.ratios), 1e-12)


def old_bound(candidate: Tensor, plain: Tensor, confidence: float = 0.95, **_: object) -> tuple[float, float]:
    """The bound before this rule: paired normal at 95 % on new data (``√2``), the largest 2.5 % of gains capped."""
    difference = candidate.double() - plain.double()
    if difference.numel() < 2 or not bool(torch.isfinite(difference).all()):
        return (
            (math.inf, math.inf) if not bool(torch.isfinite(difference).all()) else (float(difference.mean()), math.inf)
        )
    mean = float(difference.mean())
    capped = difference.clamp_min(float(torch.quantile(difference, 0.025)))
    spread = float(capped.std()) / math.sqrt(capped.numel()) * math.sqrt(2)
    return mean, float(capped.mean()) + NormalDist().inv_cdf(0.95) * spread


def point_bound(candidate: Tensor, plain: Tensor, *_: object, **__: object) -> tuple[float, float]:
    """The mean excess alone as its own bound (what the selection did before issue 34)."""
    difference = candidate.double() - plain.double()
    if not bool(torch.isfinite(difference).all()):
        return math.inf, math.inf
    mean = float(difference.mean())
    return mean, mean


RULES: dict[str, Callable | None] = {"new": None, "old": old_bound, "point": point_bound}


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def _digits_pool() -> tuple[Tensor, Tensor]:
    splits = data.load_digits()
    return (
        torch.cat([splits.calibration.tensors[0], splits.test.tensors[0]]),
        torch.cat([splits.calibration.tensors[1], splits.test.tensors[1]]),
    )


def digits_checkpoint(name: str) -> list[Checkpoint]:
    splits = data.load_digits()
    normalization = (data.MEAN, data.STD)
    return [
        Checkpoint(name, zoo.pretrained(name), data.loader(splits.fit), _digits_pool(), 600, 500, False, normalization)
    ]


def tabular_checkpoints(name: str, seeds: int = 5, label: str | None = None) -> list[Checkpoint]:
    found = []
    for seed in range(seeds):
        splits = tabular.load(name, seed=seed)
        model = tabular.overfit_mlp(splits, seed=seed)
        n = len(splits.pool[1])
        validation = min(n // 2, 400)
        train = [
            (splits.train[0][i : i + 256], splits.train[1][i : i + 256]) for i in range(0, len(splits.train[1]), 256)
        ]
        found.append(Checkpoint(label or name, model, train, splits.pool, validation, n - validation, seed=seed))
    return found


def timm_checkpoint(epochs: int = 3) -> list[Checkpoint]:
    """timm's resnet10t (random init: no weights can be downloaded here) trained on the bundled digits, cached."""
    import timm

    path = zoo.cache_dir() / f"timm_resnet10t_digits_{epochs}.pt"
    model = timm.create_model("resnet10t", pretrained=False, num_classes=8, in_chans=1)
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        splits = data.load_digits()
        torch.manual_seed(0)
        optimiser = torch.optim.AdamW(model.parameters(), 1e-3, weight_decay=0.05)
        model.train()
        for _ in range(epochs):
            for x, y in data.loader(splits.fit, 64, shuffle=True):
                optimiser.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimiser.step()
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    splits = data.load_digits()
    return [
        Checkpoint(
            "timm_resnet10t",
            model.eval(),
            data.loader(splits.fit),
            _digits_pool(),
            600,
            500,
            False,
            (data.MEAN, data.STD),
        )
    ]


def regression_checkpoint(seeds: int = 3) -> list[Checkpoint]:
    found = []
    for seed in range(seeds):
        mpg = regression.auto_mpg(seed)
        model = regression.train_mlp(mpg.train, seed=seed)
        x = torch.cat([mpg.val[0], mpg.test[0]])
        y = torch.cat([mpg.val[1], mpg.test[1]])
        validation = len(y) // 2
        found.append(
            Checkpoint("auto_mpg", model, [mpg.train], (x, y), validation, len(y) - validation, True, seed=seed)
        )
    return found


#: the tabular sets, each trained with --seeds seeds
TABULAR = {"breast_cancer": "breast_cancer", "digits_features": "digits", "wine": "wine"}
CHECKPOINTS: dict[str, Callable[..., list[Checkpoint]]] = {
    **{
        name: (lambda seeds, name=name, dataset=dataset: tabular_checkpoints(dataset, seeds, name))
        for name, dataset in TABULAR.items()
    },
    "digits_cnn": lambda: digits_checkpoint("digits_cnn"),
    "digits_bn_cnn": lambda: digits_checkpoint("digits_bn_cnn"),
    "timm_resnet10t": timm_checkpoint,
    "auto_mpg": regression_checkpoint,
}


# ---- one checkpoint ------------------------------------------------------------------------------------------------
def _per_example_nll(chain: posthoc.Method, x: Tensor, y: Tensor, regression_task: bool) -> Tensor:
    with torch.no_grad(), eval_mode(chain):
        if regression_task:
            prediction = chain.regression_predictive(x, generator=torch.Generator().manual_seed(0))
            return -prediction.log_prob(y.reshape(prediction.mean.shape)).double().reshape(len(y), -1).sum(1)
        log_probs, _ = chain.log_predictive(x, generator=torch.Generator().manual_seed(0))
    return -log_probs.double().log_softmax(-1).gather(1, y[:, None]).squeeze(1)


def _shifted_sets(checkpoint: Checkpoint, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
    x, y = checkpoint.pool
    sets = []
    for kind in EVALUATION_KINDS:
        for severity in SHIFT_SEVERITIES:
            generator = torch.Generator().manual_seed(severity)
            sets.append((corrupt_images(x[rows], kind, severity, generator, checkpoint.normalization), y[rows]))
    return sets


def run_checkpoint(checkpoint: Checkpoint, draws: int, shift: bool, methods: list[str] | None = None) -> dict:
    """Every draw's test NLL per method, and the record of auto's choice (among ``methods``, e.g. ``laplace+dac``:
    ``None``, auto's defaults)."""
    model, (x, y) = checkpoint.model, checkpoint.pool
    likelihood = Gaussian() if checkpoint.regression else Categorical()
    candidates = [c["method"] for c in default_candidates(model, likelihood)]
    if methods is not None:
        candidates = [method.split("+") for method in methods]
    options = {"likelihood": "regression"} if checkpoint.regression else {}
    um = posthoc.wrap(model, method="auto", candidates=candidates, keep_candidates=True, **options)
    batches = [(x[i : i + 256], y[i : i + 256]) for i in range(0, len(y), 256)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um.fit(checkpoint.train, batches[:1] if len(y) > 256 else batches, progress=False)
        pool = HeldOut.read(batches, model=model, likelihood=likelihood, shift="auto", device="cpu")
    with torch.no_grad():
        plain_logits = None if checkpoint.regression else model(x).double()
    rows = []
    for draw in range(draws):
        generator = torch.Generator().manual_seed(1000 * checkpoint.seed + draw)
        order = torch.randperm(len(y), generator=generator)
        validation, test = order[: checkpoint.validation], order[checkpoint.validation :][: checkpoint.test]
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um.choose(pool.subset(validation), progress=False)
        chains = {"auto": um.method, **um.method.fitted_candidates}
        # the plain model: its "none" candidate (a regressor's noise fitted on this draw's validation set)
        reference = float(_per_example_nll(chains["none"], x[test], y[test], checkpoint.regression).mean())
        row = {
            "draw": draw,
            "plain": reference,
            "chosen": um.method.chosen_label,
            "test": {
                label: float(_per_example_nll(chain, x[test], y[test], checkpoint.regression).mean())
                for label, chain in chains.items()
            },
            "record": {r["candidate"]: r.get("shifted_ratio") for r in um.summary()["selection"]["candidates"]},
            "seconds": time.perf_counter() - start,
        }
        if plain_logits is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                calibrator = TemperatureCalibrator().fit(plain_logits[validation].float(), y[validation])
            tempered = (plain_logits[test] / float(calibrator.temperature)).log_softmax(-1)
            row["test"]["calibrate temperature (MLE)"] = float(-tempered.gather(1, y[test][:, None]).mean())
        if shift and checkpoint.normalization is not None:
            sets = _shifted_sets(checkpoint, test)
            plain_shift = [float(_per_example_nll(chains["none"], sx, sy, False).mean()) for sx, sy in sets]
            row["shift"] = {
                label: statistics.fmean(
                    float(_per_example_nll(chain, sx, sy, False).mean()) / base
                    for (sx, sy), base in zip(sets, plain_shift)
                )
                for label, chain in chains.items()
            }
        rows.append(row)
        print(
            f"  {checkpoint.name} seed {checkpoint.seed} draw {draw}: auto -> {row['chosen']} ({row['seconds']:.1f} s)",
            flush=True,
        )
    return {"name": checkpoint.name, "seed": checkpoint.seed, "rows": rows}


# ---- the tables ----------------------------------------------------------------------------------------------------
def tally(runs: list[dict]) -> dict[str, dict[str, Tally]]:
    """Per checkpoint and method: worse and timid counts (module docs)."""
    found: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    for run in runs:
        for row in run["rows"]:
            plain = row["plain"]
            tolerance = max(0.02 * abs(plain), 0.005)
            tests = row["test"]
            singles = {k: v for k, v in tests.items() if k not in ("auto", "none", "calibrate temperature (MLE)")}
            best_gain = max([plain - v for v in singles.values()], default=0.0)
            for label, value in tests.items():
                if label in ("none", "calibrate temperature (MLE)"):
                    continue
                entry = found[run["name"]][label]
                entry.draws += 1
                entry.worse += value - plain > tolerance
                entry.ratios.append((value, plain))
                offered = best_gain if label == "auto" else None
                if label == "temperature" and "calibrate temperature (MLE)" in tests:
                    offered = plain - tests["calibrate temperature (MLE)"]
                if offered is not None and offered >= PLAIN_GAIN * abs(plain):
                    entry.counted += 1
                    share = (plain - value) / offered
                    entry.shares.append(share)
                    entry.timid += share < TAKEN
    return found


def shift_summary(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per image checkpoint: auto's mean NLL ratio under the evaluation kinds, the best single candidate's, and the mean
    Spearman correlation of the fit-time criterion with the evaluation-kind ratio over the candidates."""
    found = {}
    for name in dict.fromkeys(run["name"] for run in runs):
        rows = [row for run in runs if run["name"] == name for row in run["rows"] if "shift" in row]
        if not rows:
            continue
        labels = [label for label in rows[0]["shift"] if label not in ("auto",)]
        means = {label: statistics.fmean(row["shift"][label] for row in rows) for label in [*labels, "auto"]}
        correlations = []
        for row in rows:
            pairs = [
                (row["record"].get(label), row["shift"][label])
                for label in labels
                if row["record"].get(label) is not None
            ]
            if len(pairs) >= 3:
                rho = stats.spearmanr([p[0] for p in pairs], [p[1] for p in pairs]).statistic
                if math.isfinite(rho):
                    correlations.append(rho)
        best = min((label for label in labels if label != "none"), key=lambda label: means[label])
        found[name] = {
            "auto": means["auto"],
            "best": means[best],
            "best_label": best,
            "spearman": statistics.fmean(correlations) if correlations else math.nan,
        }
    return found


def render(runs: list[dict], rule: str) -> str:
    table = tally(runs)
    lines = [
        f"Rule: `{rule}`. Per checkpoint and method, over its draws: **worse** = share of draws whose test NLL exceeds the "
        f"plain model's by more than max(2 %, 0.005 nats) (target <= {WORSE_TARGET:.0%}); **timid** = draws where "
        f"less than {TAKEN:.0%} of the gain on offer was taken / draws with a gain >= {PLAIN_GAIN:.0%} on offer (target <= "
        f"{TIMID_TARGET:.0%}; for auto the best single candidate's test gain, for temperature the clean MLE temperature's); "
        "share = median share of that gain taken; ratio = mean test NLL over the draws / the plain model's.",
        "",
        "| checkpoint | method | draws | worse | timid | share taken | NLL ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, methods in table.items():
        for label, entry in sorted(methods.items(), key=lambda item: (item[0] != "auto", item[0])):
            worse = entry.worse / entry.draws
            timid = (
                f"{entry.timid}/{entry.counted}"
                + (" **missed**" if entry.counted and entry.timid / entry.counted > TIMID_TARGET else "")
                if entry.counted
                else "-"
            )
            share = f"{statistics.median(entry.shares):.2f}" if entry.shares else "-"
            flag = " **missed**" if worse > WORSE_TARGET else ""
            lines.append(
                f"| {name} | {label} | {entry.draws} | {worse:.1%}{flag} | {timid} | {share} | {entry.ratio:.3f} |"
            )
    shifted = shift_summary(runs)
    if shifted:
        lines += [
            "",
            "Under shift (evaluation kinds "
            + ", ".join(EVALUATION_KINDS)
            + f" at severities {SHIFT_SEVERITIES}, NLL / plain, "
            "mean over kinds, severities and draws); Spearman: the fit-time criterion against the evaluation-kind ratio over "
            "the candidates, mean over draws.",
            "",
            "| checkpoint | auto | best single candidate | auto - best | Spearman |",
            "|---|---:|---|---:|---:|",
        ]
        for name, row in shifted.items():
            lines.append(
                f"| {name} | {row['auto']:.3f} | {row['best_label']} {row['best']:.3f} | {row['auto'] - row['best']:+.3f} | "
                f"{row['spearman']:.2f} |"
            )
    return "\n".join(lines)


def which_method(runs: list[dict]) -> str:
    """The table of docs/which-method.md and the README: per checkpoint, auto's pick and each method's mean test NLL
    ratio in distribution and under shift, with both error rates."""
    table, shifted = tally(runs), shift_summary(runs)
    picks = defaultdict(lambda: defaultdict(int))
    for run in runs:
        for row in run["rows"]:
            picks[run["name"]][row["chosen"]] += 1
    lines = [
        "| checkpoint | auto picks | method | NLL in distribution ×plain | worse | timid | NLL under shift ×plain |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, methods in table.items():
        chosen = ", ".join(f"{label} {count}" for label, count in sorted(picks[name].items(), key=lambda i: -i[1]))
        for label, entry in sorted(methods.items(), key=lambda item: (item[0] != "auto", item[0])):
            ratio = entry.ratio
            timid = f"{entry.timid}/{entry.counted}" if entry.counted else "-"
            under = _shift_mean(runs, name, label)
            lines.append(
                f"| {name} | {chosen if label == 'auto' else ''} | {label} | {ratio:.2f}x | "
                f"{entry.worse}/{entry.draws} | {timid} | {'-' if under is None else f'{under:.2f}x'} |"
            )
    del shifted
    return "\n".join(lines)


def _shift_mean(runs: list[dict], name: str, label: str) -> float | None:
    values = [
        row["shift"][label]
        for run in runs
        if run["name"] == name
        for row in run["rows"]
        if label in row.get("shift", {})
    ]
    return statistics.fmean(values) if values else None


#: where --docs-table writes which_method's table (between the marker and the next blank line)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "which-method.md"
MARKER = "<!-- written by: python benchmarks/selection_errors.py"


def write_docs_table(text: str, command: str) -> None:
    """Replace the generated block of docs/which-method.md (its marker line and the table under it)."""
    page = DOCS.read_text()
    start = page.index(MARKER)
    end = page.index("\n\n", start)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    DOCS.write_text(page[:start] + f"{MARKER} {command}; {stamp} -->\n" + text + page[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20, help="validation/test re-draws per checkpoint")
    parser.add_argument("--seeds", type=int, default=2, help="training seeds of each tabular set (each a checkpoint)")
    parser.add_argument("--only", nargs="*", default=None, choices=list(CHECKPOINTS))
    parser.add_argument("--rule", choices=list(RULES), default="new")
    parser.add_argument("--methods", nargs="*", default=None, help="auto's candidates (default: its defaults)")
    parser.add_argument("--give-up", type=float, default=None, help="the rule's GIVE_UP (default: the library's)")
    parser.add_argument("--confidence", type=float, default=None, help="the rule's CONFIDENCE (default: the library's)")
    parser.add_argument("--no-shift", action="store_true", help="skip the evaluation kinds (faster)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the numbers do not depend on it)")
    parser.add_argument("--json", type=Path, default=None, help="also write every draw's numbers here")
    parser.add_argument("--from-json", type=Path, nargs="*", default=None, help="render these runs, no compute")
    parser.add_argument("--docs-table", action="store_true", help="write the table into docs/which-method.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if RULES[args.rule] is not None:
        selection.excess_bound = RULES[args.rule]
    if args.give_up is not None:
        selection.GIVE_UP = args.give_up
    if args.confidence is not None:
        selection.select.__kwdefaults__["confidence"] = args.confidence
    command = f"python benchmarks/selection_errors.py --draws {args.draws} --rule {args.rule}" + (
        f" --only {' '.join(args.only)}" if args.only else ""
    )
    runs = []
    if args.from_json is not None:
        for path in args.from_json:
            runs += json.loads(path.read_text())
        command = "python benchmarks/selection_errors.py --from-json " + " ".join(str(p) for p in args.from_json)
    else:
        for name in args.only or list(CHECKPOINTS):
            for checkpoint in CHECKPOINTS[name](args.seeds) if name in TABULAR else CHECKPOINTS[name]():
                runs.append(run_checkpoint(checkpoint, args.draws, shift=not args.no_shift, methods=args.methods))
            if args.json:
                args.json.write_text(json.dumps(runs))
    print(f"\n`{command}`\n")
    print(render(runs, args.rule))
    print("\n" + which_method(runs))
    if args.docs_table:
        write_docs_table(which_method(runs), command)


if __name__ == "__main__":
    main()
