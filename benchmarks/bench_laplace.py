"""Last-layer Laplace: cost as ratios to a plain forward pass, next to laplace-torch, and agreement.

Run by hand (not by pytest)::

    python benchmarks/bench_laplace.py            # all three parts
    python benchmarks/bench_laplace.py digits     # one part: digits | imagenet | peer

Parts:
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


def peer_laplace(model: nn.Module, structure: str):
    from laplace import Laplace

    return Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=structure)


def peer_marglik(la) -> None:
    la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar")


def digits() -> None:
    from posthoc.demo import data, zoo

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
        fit = measure(lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(train, progress=False), repeats=5)
        marglik = measure(lambda: posthoc.wrap(model, method="laplace", hessian=structure).fit(train, progress=False), repeats=5)
        print(row(f"plain forward, train set ({structure} block)", plain_fit, plain_fit))
        print(row(f"ours {structure}: fit", fit, plain_fit))
        print(row(f"ours {structure}: fit + marglik", marglik, plain_fit))
        peer_fit = measure(lambda: peer_laplace(model, structure).fit(train), repeats=3 if structure != "full" else 1)
        la = peer_laplace(model, structure)
        la.fit(train)
        peer_ml = measure(lambda: peer_marglik(la), repeats=3)
        print(row(f"laplace-torch {structure}: fit", peer_fit, plain_fit))
        print(row(f"laplace-torch {structure}: marglik step alone (fit + marglik = sum)", peer_ml, plain_fit))

        um = posthoc.wrap(model, method="laplace", hessian=structure).fit(train, progress=False)
        um_mc = posthoc.wrap(model, method="laplace", hessian=structure, link="mc", num_samples=100).fit(train, progress=False)
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
        print(f"| {structure}: prior precision ours {float(um.method.prior_precision):.4f} vs laplace-torch marglik "
              f"{float(la_prior(model, train, structure)):.4f}; max abs prob diff at the same prior {float(diff):.2e} | | | |")


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
        fit = measure(lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(loader, progress=False), repeats=1, warmup=0)
        um = posthoc.wrap(model, method="laplace", hessian=structure)
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


def run_peer(what: str, num: int, predict_rows: int, limit: float) -> tuple[float, float | None, torch.Tensor | None] | None:
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
        fit = measure(lambda: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(loader, progress=False), repeats=3)
        um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=1.0).fit(loader, progress=False)
        rows = 256
        predict = measure(lambda: um.predict(features[:rows]), repeats=5)
        result = run_peer(f"{structure}:fit", num, rows, limit)
        if result is not None:
            print(f"| {structure} fit, N={num} | {fit.wall:.3f} | {result[0]:.1f} | {result[0] / fit.wall:.0f}x | |")
        else:
            small = 256
            result = run_peer(f"{structure}:fit", small, rows, limit)
            text = f"> {limit:.0f} (killed); N={small} took {result[0]:.1f}, x{num // small} = {result[0] * num / small:.0f} extrapolated" if result else f"> {limit:.0f} (killed)"
            speedup = f"{result[0] * num / small / fit.wall:.0f}x (extrapolated)" if result else f"> {limit / fit.wall:.0f}x"
            print(f"| {structure} fit, N={num} | {fit.wall:.3f} | {text} | {speedup} | |")
        for peer_rows in (rows, 32):
            result = run_peer(f"{structure}:predict", num if structure == "kron" else 256, peer_rows, limit)
            if result is None or result[1] is None:
                print(f"| {structure} probit predict, {peer_rows} inputs | {predict.wall * peer_rows / rows:.4f} | > {limit:.0f} (killed or out of memory; fit included) | | |")
                continue
            ours = um.predict(features[:peer_rows]).probs if structure == "kron" else None
            if structure == "diag":  # the peer fitted on 256 examples here: compare against the same fit
                small = DataLoader(TensorDataset(features[:256], labels[:256]), batch_size=256)
                ours = posthoc.wrap(model, method="laplace", hessian="diag", prior_precision=1.0).fit(small, progress=False).predict(features[:peer_rows]).probs
            diff = float((ours - result[2]).abs().max())
            ours_time = predict.wall * peer_rows / rows
            print(f"| {structure} probit predict, {peer_rows} inputs | {ours_time:.4f} | {result[1]:.2f} | {result[1] / ours_time:.0f}x | {diff:.1e} |")
            break


if __name__ == "__main__":
    torch.manual_seed(0)
    parts = sys.argv[1:] or ["digits", "imagenet", "peer"]
    for part in parts:
        {"digits": digits, "imagenet": imagenet, "peer": peer}[part]()
