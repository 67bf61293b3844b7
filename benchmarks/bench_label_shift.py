"""``posthoc.label_shift`` on the bundled digits CNN: prior error, NLL and accuracy under synthetic label shifts.

The CNN's logits are computed once. The calibration split (600 digits, balanced) is the labelled held-out set; the
test split (1,000) is halved into a pool of deployment inputs and a pool of labelled test digits. For each shift
strength ``s`` the deployment priors are ``q = softmax(-s * rank)`` over the classes in a random order per draw, and
``--target`` deployment inputs and 2,000 test digits are drawn from the pools with those priors (with replacement).
Each estimator corrects the model; the table gives, averaged over ``--draws`` draws, the L1 error of ``q`` and the
test NLL and accuracy: no correction, BBSE, EM (on the BCTS-calibrated predictive) and the true ``q`` (with the same
calibration). A second table gives the prior error against the deployment set's size at ``s = 1``.

Run: ``python benchmarks/bench_label_shift.py [--draws 20] [--target 1000]``.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import Tensor

import posthoc
from posthoc.evaluation import metrics
from posthoc_apps.demo import data, zoo

STRENGTHS = (0.0, 0.5, 1.0, 2.0)
SIZES = (100, 300, 1000, 3000, 10000)


def shifted_draw(labels: Tensor, priors: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """Indices of ``count`` examples drawn with class priors ``priors`` (uniformly within a class, with replacement)."""
    classes = torch.multinomial(priors.float(), count, replacement=True, generator=generator)
    index = torch.empty(count, dtype=torch.long)
    for c in range(len(priors)):
        members, chosen = (labels == c).nonzero().flatten(), (classes == c).nonzero().flatten()
        index[chosen] = members[torch.randint(len(members), (len(chosen),), generator=generator)]
    return index


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--target", type=int, default=1000, help="deployment inputs per draw")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    splits = data.load_digits()
    model = zoo.pretrained("digits_cnn")
    with torch.no_grad():
        val_logits, val_labels = model(splits.calibration.tensors[0]), splits.calibration.tensors[1]
        test_logits, test_labels = model(splits.test.tensors[0]), splits.test.tensors[1]
    classes = val_logits.shape[-1]
    half = len(test_labels) // 2
    pools = {"target": (test_logits[:half], test_labels[:half]), "test": (test_logits[half:], test_labels[half:])}

    def correct(estimator: str, target: Tensor, truth: Tensor) -> tuple[Tensor, posthoc.UncertainModel]:
        shifted = posthoc.label_shift(
            logits=val_logits, labels=val_labels, target_logits=target, estimator=estimator, progress=False
        )
        if truth is not None:  # the true priors, with the same calibration
            shifted = posthoc.wrap(torch.nn.Identity(), method="label-shift", target_priors=truth.tolist())
            shifted.fit(None, [(val_logits, val_labels)], progress=False)
        return torch.tensor(shifted.method.target, dtype=torch.float64), shifted

    print(
        f"#### digits_cnn, {classes} classes: {len(val_labels)} held-out digits, {args.target} deployment inputs, "
        f"2,000 test digits, mean of {args.draws} draws\n"
    )
    print("| shift s | q error BBSE / EM | NLL none / BBSE / EM / true q | accuracy none / BBSE / EM / true q |")
    print("|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for strength in STRENGTHS:
        sums: dict[str, list[float]] = {}
        for _ in range(args.draws):
            order = torch.randperm(classes, generator=generator)
            truth = torch.softmax(-strength * order.double(), 0)
            target = pools["target"][0][shifted_draw(pools["target"][1], truth, args.target, generator)]
            test_index = shifted_draw(pools["test"][1], truth, 2000, generator)
            x_test, y_test = pools["test"][0][test_index], pools["test"][1][test_index]
            rows = {"none": torch.softmax(x_test.double(), -1)}
            for name, estimator, given in (("bbse", "bbse", None), ("em", "em", None), ("true", "em", truth)):
                priors, shifted = correct(estimator, target, given)
                rows[name] = shifted.predict(x_test).probs.double()
                if given is None:
                    sums.setdefault(f"err {name}", []).append(float((priors - truth).abs().sum()))
            for name, probs in rows.items():
                sums.setdefault(f"nll {name}", []).append(metrics.nll(probs, y_test))
                sums.setdefault(f"acc {name}", []).append(metrics.accuracy(probs, y_test))
        mean = {key: sum(values) / len(values) for key, values in sums.items()}
        names = ("none", "bbse", "em", "true")
        print(
            f"| {strength:g} | {mean['err bbse']:.3f} / {mean['err em']:.3f} | "
            + " / ".join(f"{mean[f'nll {n}']:.4f}" for n in names)
            + " | "
            + " / ".join(f"{mean[f'acc {n}']:.4f}" for n in names)
            + " |"
        )
    print("\n| deployment inputs | q error BBSE | q error EM |\n|---|---|---|")
    for size in SIZES:
        errors: dict[str, list[float]] = {"bbse": [], "em": []}
        for _ in range(args.draws):
            truth = torch.softmax(-torch.randperm(classes, generator=generator).double(), 0)
            target = pools["target"][0][shifted_draw(pools["target"][1], truth, size, generator)]
            for estimator in errors:
                priors, _ = correct(estimator, target, None)
                errors[estimator].append(float((priors - truth).abs().sum()))
        print(f"| {size} | {sum(errors['bbse']) / args.draws:.3f} | {sum(errors['em']) / args.draws:.3f} |")


if __name__ == "__main__":
    main()
