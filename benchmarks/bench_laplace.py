"""Last-layer Laplace: cost as ratios to a plain forward pass, next to laplace-torch, and agreement.

Run by hand (not by pytest)::

    python benchmarks/bench_laplace.py            # all four parts
    python benchmarks/bench_laplace.py quality    # one part: quality | digits | imagenet | peer

Parts:
  quality  — the brief's quality protocol on both bundled models (digits_cnn, digits_bn_cnn):
             ``fit(loader(fit, 64, shuffle=True), loader(calibration))``, NLL / ECE on the test
             digits rotated 0/45/90 degrees for the plain model, the old default (marglik) and the
             new one (``prior_precision="auto"``), and val / grid / marglik with kron and full; then
             the default, fitted on each of 8 random validation/test splits of calibration + test (worst
             in-distribution NLL ratio, mean ratios at 45/90) and the fit cost of the prior search
             (fit with ``"auto"`` vs a fixed prior, as ratios to one plain forward over the fit set).
  digits   — the bundled CNN: fit / fit+marglik over the 2,400 training digits as ratios to one
             plain forward pass over them; probit and MC (S=100) predict on 1,000 test digits as
             ratios to the plain forward pass on them; ours and laplace-torch's, back to back.
  imagenet — synthetic ImageNet-shaped features (N=5,000, D=2,048, C=1,000): fit and predict times.
  peer     — D=512, C=100, N=2,048 synthetic features, ours vs laplace-torch (time-capped), with
             the max abs difference of the probabilities.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import HEADER, measure, row  # noqa: E402

warnings.filterwarnings("ignore")


QUALITY_CONFIGS = (
    ("old default: kron, marglik", {"prior_precision": "marglik"}),
    ("new default: kron, auto (val)", {}),
    ("kron, grid (val-NLL minimiser)", {"prior_precision": "grid"}),
    ("full, marglik", {"hessian": "full", "prior_precision": "marglik"}),
    ("full, auto (val)", {"hessian": "full"}),
    ("full, grid", {"hessian": "full", "prior_precision": "grid"}),
    ("kron, auto (val), link=mc", {"link": "mc"}),
    ("kron, auto without val_loader (training data)", {"no_val": True}),
)
ANGLES = (0, 45, 90)


def quality() -> None:
    from posthoc_apps.demo import data, zoo

    splits = data.load_digits()
    tests = {angle: data.loader(data.rotated(splits.test, angle), 500) for angle in ANGLES}
    print("\n### quality: NLL / ECE on the test digits rotated 0/45/90 degrees (fit(train, calibration))\n")
    print(
        "| model | posterior | δ | "
        + " | ".join(f"NLL {a}° | ECE {a}°" for a in ANGLES)
        + " | NLL 0° / plain | meets |"
    )
    print("|---|---|---|" + "---|---|" * len(ANGLES) + "---|---|")
    for name in ("digits_cnn", "digits_bn_cnn"):
        model = zoo.pretrained(name)
        plain = {
            a: posthoc.evaluate(posthoc.wrap(model, method="none"), loader, progress=False)
            for a, loader in tests.items()
        }
        print(
            f"| {name} | plain | | "
            + " | ".join(f"{plain[a].nll:.4f} | {plain[a].ece:.2%}" for a in ANGLES)
            + " | 1.000 | |"
        )
        for label, options in QUALITY_CONFIGS:
            options = dict(options)
            val = None if options.pop("no_val", False) else data.loader(splits.calibration)
            um = posthoc.wrap(model, method="laplace", **options).fit(
                data.loader(splits.fit, 64, shuffle=True), val, progress=False
            )
            ours = {a: posthoc.evaluate(um, loader, progress=False) for a, loader in tests.items()}
            meets = ours[0].nll <= 1.02 * plain[0].nll and all(ours[a].nll < plain[a].nll for a in (45, 90))
            print(
                f"| {name} | {label} | {float(um.method.prior_precision):.4g} | "
                + " | ".join(f"{ours[a].nll:.4f} | {ours[a].ece:.2%}" for a in ANGLES)
                + f" | {ours[0].nll / plain[0].nll:.3f} | {'yes' if meets else 'NO'} |"
            )
    random_splits(data, zoo, splits)
    prior_search_cost(data, zoo, splits)


def random_splits(data, zoo, splits, count: int = 8) -> None:
    """The default, fitted once per split, over ``count`` random 600 / 1,000 validation/test splits of
    calibration + test."""
    x = torch.cat([splits.calibration.tensors[0], splits.test.tensors[0]])
    y = torch.cat([splits.calibration.tensors[1], splits.test.tensors[1]])
    rotated = {a: data.rotated(TensorDataset(x, y), a).tensors[0] for a in ANGLES}
    print(f"\n### the default over {count} random validation (600) / test (1,000) splits: test NLL / plain NLL\n")
    print(
        "| model | δ min-max | NLL 0° ratio worst | mean | NLL 45° ratio mean (worst) "
        "| NLL 90° ratio mean (worst) |\n|---|---|---|---|---|---|"
    )
    for name in ("digits_cnn", "digits_bn_cnn"):
        model = zoo.pretrained(name)
        ratios, deltas = {a: [] for a in ANGLES}, []
        for split in range(count):
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(split))
            val, test = order[:600], order[600:]
            um = posthoc.wrap(model, method="laplace").fit(
                data.loader(splits.fit, 256), [(x[val], y[val])], progress=False
            )
            deltas.append(float(um.method.prior_precision))
            with torch.no_grad():
                for a in ANGLES:
                    plain = nn.functional.cross_entropy(model(rotated[a][test]), y[test])
                    ours = nn.functional.nll_loss(um.method.log_predictive(rotated[a][test])[0], y[test])
                    ratios[a].append(float(ours / plain))
        mean = {a: sum(r) / len(r) for a, r in ratios.items()}
        print(
            f"| {name} | {min(deltas):.3g}-{max(deltas):.3g} | {max(ratios[0]):.3f} | {mean[0]:.3f} | "
            f"{mean[45]:.3f} ({max(ratios[45]):.3f}) | {mean[90]:.3f} ({max(ratios[90]):.3f}) |"
        )


def prior_search_cost(data, zoo, splits) -> None:
    """Fit cost of each prior rule as a ratio to one plain forward pass over the 2,400 fit digits."""
    train, val = data.loader(splits.fit, 256), data.loader(splits.calibration, 256)
    print(
        f"\n### fit cost of the prior search (2,400 fit digits, 600 validation digits; {torch.get_num_threads()} threads)\n"
    )
    print(HEADER)
    for name in ("digits_cnn", "digits_bn_cnn"):
        model = zoo.pretrained(name)

        def forward_train() -> None:
            with torch.no_grad():
                for x, _ in train:
                    model(x)

        plain = measure(forward_train, repeats=5)
        print(row(f"{name}: plain forward over the fit set", plain, plain))
        for label, options, held_out in (
            ("fit, fixed prior (curvature only)", {"prior_precision": 1.0}, None),
            ("fit, marglik", {"prior_precision": "marglik"}, None),
            ("fit, auto with val_loader", {}, val),
            ("fit, auto without val_loader (training data)", {}, None),
            ("fit, grid", {"prior_precision": "grid"}, val),
            ("fit, auto with val_loader, link=mc (S=100)", {"link": "mc"}, val),
        ):
            timing = measure(
                lambda: posthoc.wrap(model, method="laplace", **options).fit(train, held_out, progress=False), repeats=3
            )
            print(row(f"{name}: {label}", timing, plain))


def peer_laplace(model: nn.Module, structure: str):
    from laplace import Laplace

    return Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=structure)


def peer_marglik(la) -> None:
    la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar")


def digits() -> None:
    from posthoc_apps.demo import data, zoo

    splits = data.load_digits()
    train = data.loader(splits.fit, batch_size=256)
    x_test = splits.test.tensors[0]
    model = zoo.pretrained()

    def forward_train() -> None:
        with torch.no_grad():
            for x, _ in train:
                model(x)

    print(f"\n### digits CNN (fit: 2,400 digits; predict: 1,000 digits; {torch.get_num_threads()} threads)\n")
    print(HEADER)
    for structure in ("kron", "diag", "full"):
        plain_fit = measure(forward_train, repeats=5)
        fit = measure(
            lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(
                train, progress=False
            ),
            repeats=5,
        )
        marglik = measure(
            lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision="marglik").fit(
                train, progress=False
            ),
            repeats=5,
        )
        print(row(f"plain forward, train set ({structure} block)", plain_fit, plain_fit))
        print(row(f"ours {structure}: fit", fit, plain_fit))
        print(row(f"ours {structure}: fit + marglik", marglik, plain_fit))
        peer_fit = measure(lambda: peer_laplace(model, structure).fit(train), repeats=3 if structure != "full" else 1)
        la = peer_laplace(model, structure)
        la.fit(train)
        peer_ml = measure(lambda: peer_marglik(la), repeats=3)
        print(row(f"laplace-torch {structure}: fit", peer_fit, plain_fit))
        print(row(f"laplace-torch {structure}: marglik step alone (fit + marglik = sum)", peer_ml, plain_fit))

        um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision="marglik").fit(
            train, progress=False
        )
        um_mc = posthoc.wrap(
            model, method="laplace", hessian=structure, link="mc", num_samples=100, prior_precision="marglik"
        ).fit(train, progress=False)
        plain = measure(lambda: torch.no_grad()(model)(x_test), repeats=9)
        probit = measure(lambda: um.predict(x_test), repeats=9)
        mc = measure(lambda: um_mc.predict(x_test), repeats=9)
        with torch.no_grad():
            peer_probit = measure(lambda: la(x_test, pred_type="glm", link_approx="probit"), repeats=5)
            peer_mc = measure(lambda: la(x_test, pred_type="glm", link_approx="mc", n_samples=100), repeats=3)
            la.prior_precision = float(um.method.prior_precision)
            diff = (um.predict(x_test).probs - la(x_test, pred_type="glm", link_approx="probit")).abs().max()
        print(row(f"plain forward, test set ({structure} block)", plain, plain))
        print(row(f"ours {structure}: probit predict", probit, plain))
        print(row(f"ours {structure}: MC S=100 predict", mc, plain))
        print(row(f"laplace-torch {structure}: probit predict", peer_probit, plain))
        print(row(f"laplace-torch {structure}: MC S=100 predict", peer_mc, plain))
        print(
            f"| {structure}: prior precision ours {float(um.method.prior_precision):.4f} vs laplace-torch marglik "
            f"{float(la_prior(model, train, structure)):.4f}; max abs prob diff at the same prior {float(diff):.2e} | | | |"
        )


def la_prior(model: nn.Module, train: DataLoader, structure: str) -> float:
    la = peer_laplace(model, structure)
    la.fit(train)
    peer_marglik(la)
    return float(la.prior_precision)


def synthetic(num: int, width: int, classes: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A linear head on random features with labels drawn from a (sharper) teacher head."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num, width, generator=generator)
    head = nn.Linear(width, classes)
    with torch.no_grad():
        head.weight.copy_(torch.randn(classes, width, generator=generator) / width**0.5 * 3)
        head.bias.copy_(torch.randn(classes, generator=generator) * 0.1)
        labels = torch.distributions.Categorical(logits=head(features)).sample()
    return nn.Sequential(nn.Flatten(), head).eval(), features, labels  # laplace-torch needs >1 module


def imagenet() -> None:
    num, width, classes = 5000, 2048, 1000
    model, features, labels = synthetic(num, width, classes)
    loader = DataLoader(TensorDataset(features, labels), batch_size=500)
    x = features[:256]
    print(f"\n### ImageNet-shaped synthetic features (N={num}, D={width}, C={classes}; predict 256 inputs)\n")
    print(HEADER)
    plain = measure(lambda: torch.no_grad()(model)(features), repeats=3)
    print(row("plain forward of the head, 5,000 inputs", plain, plain))
    for structure in ("kron", "diag"):
        fit = measure(
            lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(
                loader, progress=False
            ),
            repeats=1,
            warmup=0,
        )
        um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision="marglik")
        marglik = measure(lambda: um.fit(loader, progress=False), repeats=1, warmup=0)
        probit = measure(lambda: um.predict(x), repeats=3)
        um_mc = posthoc.wrap(model, method="laplace", hessian=structure, link="mc", num_samples=100)
        um_mc.method.load_posterior_state(um.method.posterior_state())
        um_mc.method.fitted.fill_(True)
        mc = measure(lambda: um_mc.predict(x), repeats=1)
        print(row(f"ours {structure}: fit", fit, plain))
        print(row(f"ours {structure}: fit + marglik", marglik, plain))
        print(row(f"ours {structure}: probit predict, 256 inputs", probit, plain))
        print(row(f"ours {structure}: MC S=100 predict, 256 inputs", mc, plain))
    try:
        posthoc.wrap(model, method="laplace", hessian="full")
    except posthoc.ConfigError as err:
        print(f"\nhessian='full' refused before allocating: {err}")


def _peer_job(queue: mp.Queue, what: str, num: int, predict_rows: int) -> None:
    torch.set_num_threads(2)
    model, features, labels = synthetic(2048, 512, 100)
    features, labels = features[:num], labels[:num]
    loader = DataLoader(TensorDataset(features, labels), batch_size=256)
    structure = what.split(":")[0]
    start = time.perf_counter()
    la = peer_laplace(model, structure)
    la.fit(loader)
    fit = time.perf_counter() - start
    probs, predict = None, None
    if what.endswith(":predict"):
        la.prior_precision = 1.0
        start = time.perf_counter()
        with torch.no_grad():
            probs = la(features[:predict_rows], pred_type="glm", link_approx="probit")
        predict = time.perf_counter() - start
    queue.put((fit, predict, probs))


def run_peer(
    what: str, num: int, predict_rows: int, limit: float
) -> tuple[float, float | None, torch.Tensor | None] | None:
    """Run a laplace-torch job in a fresh child process, killed after ``limit`` seconds (``None`` then)."""
    context = mp.get_context("spawn")  # not fork: a forked child can deadlock in torch's thread pool
    queue = context.Queue()
    process = context.Process(target=_peer_job, args=(queue, what, num, predict_rows))
    process.start()
    try:
        result = queue.get(timeout=limit)  # read before join: a large result blocks the child until read
    except Exception:  # queue.Empty: out of time (or the child died, e.g. out of memory)
        result = None
    if process.is_alive():
        process.kill()
    process.join()
    return result


def peer(limit: float = 240.0) -> None:
    num, width, classes = 2048, 512, 100
    model, features, labels = synthetic(num, width, classes)
    loader = DataLoader(TensorDataset(features, labels), batch_size=256)
    print(f"\n### vs laplace-torch at D={width}, C={classes}, N={num} (peer capped at {limit:.0f} s per job)\n")
    print("| what | ours s | laplace-torch s | speed-up | max abs prob diff |\n|---|---|---|---|---|")
    for structure in ("kron", "diag"):
        fit = measure(
            lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(
                loader, progress=False
            ),
            repeats=3,
        )
        um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(loader, progress=False)
        rows = 256
        predict = measure(lambda: um.predict(features[:rows]), repeats=5)
        result = run_peer(f"{structure}:fit", num, rows, limit)
        if result is not None:
            print(f"| {structure} fit, N={num} | {fit.wall:.3f} | {result[0]:.1f} | {result[0] / fit.wall:.0f}x | |")
        else:
            small = 256
            result = run_peer(f"{structure}:fit", small, rows, limit)
            text = (
                f"> {limit:.0f} (killed); N={small} took {result[0]:.1f}, x{num // small} = {result[0] * num / small:.0f} extrapolated"
                if result
                else f"> {limit:.0f} (killed)"
            )
            speedup = (
                f"{result[0] * num / small / fit.wall:.0f}x (extrapolated)" if result else f"> {limit / fit.wall:.0f}x"
            )
            print(f"| {structure} fit, N={num} | {fit.wall:.3f} | {text} | {speedup} | |")
        for peer_rows in (rows, 32):
            result = run_peer(f"{structure}:predict", num if structure == "kron" else 256, peer_rows, limit)
            if result is None or result[1] is None:
                print(
                    f"| {structure} probit predict, {peer_rows} inputs | {predict.wall * peer_rows / rows:.4f} "
                    f"| > {limit:.0f} (killed or out of memory; fit included) | | |"
                )
                continue
            ours = um.predict(features[:peer_rows]).probs if structure == "kron" else None
            if structure == "diag":  # the peer fitted on 256 examples here: compare against the same fit
                small = DataLoader(TensorDataset(features[:256], labels[:256]), batch_size=256)
                ours = (
                    posthoc.wrap(model, method="laplace", hessian="diag", prior_precision=1.0)
                    .fit(small, progress=False)
                    .predict(features[:peer_rows])
                    .probs
                )
            diff = float((ours - result[2]).abs().max())
            ours_time = predict.wall * peer_rows / rows
            print(
                f"| {structure} probit predict, {peer_rows} inputs | {ours_time:.4f} | {result[1]:.2f} | {result[1] / ours_time:.0f}x | {diff:.1e} |"
            )
            break


if __name__ == "__main__":
    torch.manual_seed(0)
    parts = sys.argv[1:] or ["quality", "digits", "imagenet", "peer"]
    for part in parts:
        {"quality": quality, "digits": digits, "imagenet": imagenet, "peer": peer}[part]()
