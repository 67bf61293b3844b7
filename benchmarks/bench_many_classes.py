"""Heads with many classes: last-layer Laplace at ImageNet-21k and GPT-2 LM-head shapes, and laplace-torch beside it.

The "model" is a linear head on synthetic features, ``nn.Sequential(nn.Identity(), nn.Linear(D, C))``
(``bench_imagenet_shape.synthetic``: fixed seed, labels from a random teacher, the checkpoint a noisy copy of it),
so a plain forward pass is exactly one head matmul and every time is a ratio to it. Every case runs in its own
subprocess (``bench_imagenet_shape``'s peak measurement: the growth of the resident set over the call, large
blocks forced to ``mmap``; on a GPU the allocated memory), timings are medians with CPU time beside wall
(``benchmarks/timing.py``).

Above 4,096 classes ``hessian="kron"`` (the default) is held as ``"kron-diag"``: KFAC with the exact diagonal
of the softmax GGN's output factor (``posthoc/methods/laplace/kron_diag.py``).

Parts:
  shapes — D=1,024 C=21,843 (ImageNet-21k) and D=768 V=50,257 (GPT-2's LM head), N=5,000 features: fit
           (prior fixed; and with the evidence's prior), probit predict on the same 5,000 (and ``method="none"``'s
           predict, the same outputs without a posterior), MC predict (S=100) on 100 rows, all under the default
           ``posthoc.settings.max_memory`` (512 MiB).
  defaults — ``posthoc.wrap(head, method="laplace").fit(train_loader[, val_loader])`` at the ImageNet-21k shape with
           nothing else set, and with ``prior_precision="marglik"``: the fit's CPU and wall time over one head forward
           over the N training rows, and its peak growth (targets: <= 5x, <= 2 GiB).
  peer   — laplace-torch's last-layer KFAC and diag, fit and GLM probit predict, at growing C (D=1,024,
           fit on 5,000, predict on PEER_ROWS rows), each under PEER_SECONDS and an address-space cap of
           PEER_MEMORY; posthoc's default at the same shapes.

Run (about 10 minutes on 2 idle cores)::

    python benchmarks/bench_many_classes.py                 # both parts; writes benchmarks/results/many_classes.{md,json}
    python benchmarks/bench_many_classes.py shapes
    python benchmarks/bench_many_classes.py defaults       # the one line's fit (a few minutes)
    python benchmarks/bench_many_classes.py --device cuda   # model and features on the GPU
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_imagenet_shape import CHILD_ENV, MiB, peak_growth, synthetic  # noqa: E402

#: S of the sampling predictive, and the rows it is timed on
SAMPLES, MC_ROWS = 100, 100
#: rows the predictives are timed on beside laplace-torch, whose GLM predictive forms (rows, C, C (D+1)) Jacobians
#: and so is called one row at a time
PEER_ROWS = 8
#: rows of the validation loader part "defaults" passes with "+val"
VAL_ROWS = 1000
#: wall seconds and address space each laplace-torch case gets before it counts as "does not run"
PEER_SECONDS, PEER_MEMORY = 240, 8 * 2**30


@dataclass
class Case:
    """One subprocess: a library at one shape."""

    library: str  # "posthoc" | "laplace-torch"
    width: int
    classes: int
    num_fit: int = 5000
    num_predict: int = 5000
    hessian: str = "kron"
    marglik: bool = True
    mc: bool = True
    device: str = "cpu"
    repeats: int = 3
    #: part "defaults": the one fit to time, ``wrap(head, method="laplace"[, prior_precision=...])`` as a user calls it
    #: (``"default"``, ``"marglik"``; ``"+val"``: with a val_loader of VAL_ROWS other rows), nothing else set
    fit_only: str | None = None


def run_case(case: Case) -> dict:
    import warnings

    import torch
    from timing import measure
    from torch.utils.data import DataLoader, TensorDataset

    import posthoc

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, train_x, train_y, x = synthetic(case.num_fit, case.num_predict, case.width, case.classes, case.device)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=500)
    rows: list[dict] = []
    out: dict = {"case": asdict(case), "rows": rows, "threads": torch.get_num_threads()}

    def record(what: str, fn, reference, repeats: int = 1) -> None:
        try:
            found: list[int] = []
            first = measure(lambda: found.append(peak_growth(fn, case.device)), repeats=1, warmup=0)
            peak = found[0]
            timing = first if repeats == 1 else measure(fn, repeats=repeats, warmup=0)  # the first call warmed up
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            rows.append({"what": what, "error": str(err).split("\n")[0][:160]})
            return
        rows.append(
            {
                "what": what,
                "wall": timing.wall,
                "cpu": timing.cpu,
                "ref_wall": reference.wall,
                "ref_cpu": reference.cpu,
                "contended": case.device == "cpu" and (timing.contended or reference.contended),
                "peak": peak,
            }
        )

    if case.fit_only is not None:
        return run_default_fit(case, model, train_x, train_y, x, out)
    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=max(3, case.repeats))
        plain_fit = measure(lambda: model(train_x), repeats=max(3, case.repeats))
    rows.append({"what": "plain head forward", "wall": plain.wall, "cpu": plain.cpu, "ref_wall": plain.wall,
                 "ref_cpu": plain.cpu, "contended": plain.contended, "peak": None})  # fmt: skip
    # one fit on 50 rows first, so that the measured peak holds no code loaded on a first call
    warm = DataLoader(TensorDataset(train_x[:50], train_y[:50]), batch_size=50)
    if case.library == "laplace-torch":
        from laplace import Laplace

        try:
            Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=case.hessian).fit(
                warm, progress_bar=False
            )
        except (RuntimeError, MemoryError):
            pass
        la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=case.hessian)
        record(f"fit {case.hessian} (N={case.num_fit:,})", lambda: la.fit(loader, progress_bar=False), plain_fit)
        if "error" in rows[-1]:
            return out
        la.prior_precision = 1.0
        rows_x = x[:PEER_ROWS]
        with torch.no_grad():
            plain_rows = measure(lambda: model(rows_x), repeats=5)
        record(
            f"predict probit ({PEER_ROWS} rows)",
            lambda: torch.cat(
                [la(rows_x[i : i + 1], pred_type="glm", link_approx="probit") for i in range(len(rows_x))]
            ),
            plain_rows,
        )
        return out
    posthoc.wrap(model, method="laplace", hessian=case.hessian, prior_precision=1.0).fit(warm, progress=False)
    um = posthoc.wrap(model, method="laplace", hessian=case.hessian, prior_precision=1.0)
    record(f"fit, prior 1.0 (N={case.num_fit:,})", lambda: um.fit(loader, progress=False), plain_fit)
    out["structure"] = type(um.method.curvature).__name__
    if case.marglik:
        evidence = posthoc.wrap(model, method="laplace", hessian=case.hessian, prior_precision="marglik")
        record(f"fit + marglik (N={case.num_fit:,})", lambda: evidence.fit(loader, progress=False), plain_fit)
        out["prior_precision"] = float(evidence.method.prior_precision)
    record(
        f"predict probit (N={case.num_predict:,})",
        lambda: um.predict(x, keep_samples=False),
        plain,
        repeats=case.repeats,
    )
    if case.mc:  # the posterior's predictive alone: the head forward, the variances and the probit, no summaries
        record(
            f"probit log-predictive alone (N={case.num_predict:,})",
            lambda: um.method.log_predictive(x),
            plain,
            repeats=case.repeats,
        )
    plain_predict = posthoc.wrap(model, method="none")  # the same outputs without a posterior: the engine's share
    record(
        f"predict, method='none' (N={case.num_predict:,})",
        lambda: plain_predict.predict(x, keep_samples=False),
        plain,
        repeats=case.repeats,
    )
    if case.mc:
        mc = posthoc.wrap(model, method="laplace", hessian=case.hessian, prior_precision=1.0, link="mc")
        mc.method.load_posterior_state(um.method.posterior_state())
        mc.method.fitted.fill_(True)
        with torch.no_grad():
            plain_mc = measure(lambda: model(x[:MC_ROWS]), repeats=5)
        record(
            f"predict MC S={SAMPLES} ({MC_ROWS} rows)",
            lambda: mc.predict(x[:MC_ROWS], num_samples=SAMPLES, keep_samples=False),
            plain_mc,
        )
    return out


def run_default_fit(case: Case, model, train_x, train_y, x, out: dict) -> dict:
    """Part "defaults": one ``fit`` with only the prior's mode set, against one head forward over the N training rows."""
    import time

    import torch
    from timing import measure
    from torch.utils.data import DataLoader, TensorDataset

    import posthoc

    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=500)
    with torch.no_grad():  # the validation rows: other features, labelled by the checkpoint's own noisy teacher
        val_x = x[-VAL_ROWS:] + 0.1 * torch.randn(VAL_ROWS, x.shape[1], generator=torch.Generator().manual_seed(1))
        val_y = torch.distributions.Categorical(logits=model(val_x)).sample()
    val = DataLoader(TensorDataset(val_x, val_y), batch_size=500) if case.fit_only.endswith("+val") else None
    mode = case.fit_only.removesuffix("+val")
    options = {} if mode == "default" else {"prior_precision": mode}
    warm = DataLoader(TensorDataset(train_x[:50], train_y[:50]), batch_size=50)
    posthoc.wrap(model, method="laplace", **options).fit(warm, warm if val is not None else None, progress=False)
    with torch.no_grad():
        plain = measure(lambda: model(train_x), repeats=max(3, case.repeats))
    um = posthoc.wrap(model, method="laplace", **options)
    wall, cpu = time.perf_counter(), time.process_time()
    peak = peak_growth(lambda: um.fit(loader, val, progress=False), case.device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    selection = um.summary().get("selection") or {}
    out["rows"].append(
        {
            "what": f"fit, {case.fit_only} (N={case.num_fit:,}" + (f", val {VAL_ROWS:,})" if val is not None else ")"),
            "wall": wall,
            "cpu": cpu,
            "ref_wall": plain.wall,
            "ref_cpu": plain.cpu,
            "contended": case.device == "cpu" and (cpu / wall < 0.5 or plain.contended),
            "peak": peak,
        }
    )
    out["prior_precision"] = float(um.method.prior_precision)
    out["rungs_scored"] = sum(1 for c in selection.get("candidates", []) if c.get("clean_nll") is not None)
    out["structure"] = type(um.method.curvature).__name__
    return out


# ----------------------------------------------------------------------------- parent side
def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (PEER_MEMORY, PEER_MEMORY))


def launch(case: Case, timeout: float = 900.0) -> dict:
    """Run ``case`` in a fresh interpreter (laplace-torch: under PEER_SECONDS and PEER_MEMORY); re-run once if contended."""
    peer = case.library == "laplace-torch"
    result: dict = {}
    for attempt in range(2):
        command = [sys.executable, __file__, "--case", json.dumps(asdict(case))]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=PEER_SECONDS if peer else timeout,
                env={**os.environ, **CHILD_ENV},
                preexec_fn=_limit_memory if peer and case.device == "cpu" else None,
            )
        except subprocess.TimeoutExpired:
            return {"case": asdict(case), "error": f"timed out after {PEER_SECONDS if peer else timeout:.0f} s"}
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return {"case": asdict(case), "error": (lines[-1] if lines else f"exit {done.returncode}")[:200]}
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["attempts"] = attempt + 1
        if not any(row.get("contended") for row in result["rows"]):
            break
    return result


HEADER = (
    "| library | shape | what | wall s | x head forward (wall) | x head forward (cpu) | cpu/wall | peak growth MiB |\n"
    "|---|---|---|---|---|---|---|---|"
)


def rows_of(result: dict) -> list[str]:
    case = result["case"]
    name = case["library"] + ("" if case["library"] == "posthoc" else f" {case['hessian']}")
    if "structure" in result:
        name += f" ({result['structure']})"
    shape = f"D={case['width']:,} C={case['classes']:,}"
    if "error" in result:
        return [f"| {name} | {shape} | FAILED: {result['error']} | | | | | |"]
    lines = []
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {name} | {shape} | {row['what']}: FAILED: {row['error']} | | | | | |")
            continue
        peak = "" if row["peak"] is None else f"{row['peak'] / MiB:,.0f}"
        lines.append(
            f"| {name} | {shape} | {row['what']} | {row['wall']:.3f} | {row['wall'] / row['ref_wall']:.2f}x | "
            f"{row['cpu'] / row['ref_cpu']:.2f}x | {row['cpu'] / row['wall']:.2f}"
            f"{' (contended)' if row['contended'] else ''} | {peak} |"
        )
    return lines


def part_shapes(device: str) -> tuple[list[str], list[dict]]:
    lines = ["### Many classes: N=5,000 features, default max_memory (512 MiB)", "", HEADER]
    results = []
    for width, classes in ((1024, 21843), (768, 50257)):
        result = launch(Case("posthoc", width, classes, device=device, repeats=3 if device == "cpu" else 5))
        results.append(result)
        lines += rows_of(result)
        print("\n".join(rows_of(result)), flush=True)
    return lines, results


def part_peer(device: str) -> tuple[list[str], list[dict]]:
    lines = [
        f"### Beside laplace-torch: last layer, D=1,024, fit on 5,000, predict {PEER_ROWS} rows "
        f"(laplace-torch under {PEER_SECONDS} s and {PEER_MEMORY / 2**30:.0f} GiB per case)",
        "",
        HEADER,
    ]
    results = []
    for classes in (100, 300, 1000):
        for case in (
            Case("laplace-torch", 1024, classes, num_predict=PEER_ROWS, hessian="kron", device=device),
            Case("laplace-torch", 1024, classes, num_predict=PEER_ROWS, hessian="diag", device=device),
            Case("posthoc", 1024, classes, num_predict=PEER_ROWS, marglik=False, mc=False, device=device),
        ):
            result = launch(case)
            results.append(result)
            lines += rows_of(result)
            print("\n".join(rows_of(result)), flush=True)
    return lines, results


def part_defaults(device: str) -> tuple[list[str], list[dict]]:
    lines = [
        f"### The one line: fit with nothing but the prior's mode set, D=1,024 C=21,843, N=5,000 (val: {VAL_ROWS:,} "
        "other rows), default max_memory (512 MiB); target <= 5x one head forward over the N rows, <= 2 GiB",
        "",
        HEADER,
    ]
    results = []
    for fit_only in ("default", "default+val", "marglik", "marglik+val"):
        result = launch(Case("posthoc", 1024, 21843, device=device, fit_only=fit_only, repeats=3))
        results.append(result)
        lines += rows_of(result)
        extra = f"prior {result.get('prior_precision', float('nan')):.4g}, rungs scored {result.get('rungs_scored')}"
        print("\n".join(rows_of(result)) + f"  ({extra})", flush=True)
    return lines, results


PARTS = {"shapes": part_shapes, "peer": part_peer, "defaults": part_defaults}

if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(run_case(Case(**json.loads(sys.argv[2])))))
        sys.exit(0)
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"any of {list(PARTS)} (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", default=str(HERE / "results" / "many_classes"), help="results path without suffix")
    args = parser.parse_args()
    where = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        if args.device != "cpu"
        else f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
    )
    header = f"{where}; every case in a fresh process; peak growth over the call ({'GPU allocated' if args.device != 'cpu' else 'resident'} memory)"
    print(header, flush=True)
    lines, results = [header, ""], {}
    for part in args.parts or list(PARTS):
        if part not in PARTS:
            parser.error(f"unknown part {part!r}; choose from {list(PARTS)}")
        part_lines, results[part] = PARTS[part](args.device)
        lines += [""] + part_lines
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    Path(args.out + suffix + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + suffix + ".json").write_text(json.dumps({"where": where, "parts": results}, indent=1) + "\n")
