"""ImageNet-shaped batched sampling on CPU: last-layer Laplace (KFAC), last-layer SWAG, head MC dropout.

The "model" is a feature-extractor stand-in plus a linear head, ``nn.Sequential(nn.Identity(),
nn.Linear(D, C))``, fed with synthetic features ``phi (N, D)`` (fixed seed; labels drawn from a
random teacher head, the checkpoint is a noisy copy of the teacher), so a plain forward pass is
exactly one head matmul. Every case runs in its own subprocess, which times the plain forward pass
and the method back to back (``benchmarks/timing.py``: medians, ratios, cpu/wall) and measures the
peak resident memory of one ``predict``: the kernel's high-water mark (``VmHWM``) is reset through
``/proc/self/clear_refs`` right before the call, and the growth over the resident size just before
it is reported. Large allocations are forced to ``mmap`` (``MALLOC_MMAP_THRESHOLD_``) so freed
blocks go back to the kernel and a warm heap does not hide a peak. Predictions stream
(``keep_samples=False``): the outputs are ``(N, C)`` probabilities plus five ``(N,)`` vectors.

Parts:
  main    — N=5,000, D=2,048, C=1,000: fit and predict (probit; MC S=100) as ratios to one head forward.
  growth  — C in {10, 100, 1000} (N=5,000, D=2,048); N in {1k, 10k, 100k} (D=512, C=100; fit on
            at most 10k); MC overhead (S=100 minus the deterministic / S=1 predict) vs D in {256, 2048}.
  budget  — the main-shape MC predict under max_memory = 64 MiB (``predict(max_memory=...)``) and
            1 GiB (``posthoc.settings.max_memory``).

Run (about 10 minutes on 2 idle cores)::

    python benchmarks/bench_imagenet_shape.py                 # all parts
    python benchmarks/bench_imagenet_shape.py main budget     # some parts
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 2**20
#: S for every sampling predictive
SAMPLES = 100
#: force large blocks to mmap (returned on free), so each predict's peak is measured from a cold heap
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MiB), "MALLOC_TRIM_THRESHOLD_": str(MiB)}


@dataclass
class Case:
    """One subprocess: a method at one shape, with the predicts to time."""

    method: str  # "laplace" | "swag" | "mc-dropout"
    num_fit: int
    num_predict: int
    width: int
    classes: int
    predicts: list[str]  # "probit" | "mc" (Laplace) | "S=<k>" (SWAG, MC dropout)
    fit: bool = True
    repeats: int = 3
    max_memory: int | None = None  # passed to predict(max_memory=...)
    settings_memory: int | None = None  # set as posthoc.settings.max_memory instead
    label: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- child side
def _proc_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+)", status.read()).group(1)) * 1024


def peak_growth(fn) -> int:
    """Bytes the resident set grew by at its peak while ``fn()`` ran (Linux high-water mark)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident size
    before = _proc_bytes("VmRSS")
    fn()
    return _proc_bytes("VmHWM") - before


def synthetic(num_fit: int, num_predict: int, width: int, classes: int, seed: int = 0):
    """Features, teacher labels and a checkpoint head ``Sequential(Identity, Linear)`` (noisy teacher)."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(classes, width, generator=generator) * 3 / width**0.5
    features = torch.randn(max(num_fit, num_predict), width, generator=generator)
    labels = torch.distributions.Categorical(logits=features[:num_fit] @ teacher.T).sample()
    head = nn.Linear(width, classes)
    with torch.no_grad():
        head.weight.copy_(teacher + 0.3 * torch.randn(classes, width, generator=generator) / width**0.5)
        head.bias.zero_()
    return nn.Sequential(nn.Identity(), head).eval(), features[:num_fit], labels, features[:num_predict]


def run_case(case: Case) -> dict:
    """Time fit and predicts of one case against the plain forward; measure each predict's peak RSS."""
    import warnings

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import posthoc
    from timing import measure

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, train_x, train_y, x = synthetic(case.num_fit, case.num_predict, case.width, case.classes)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=max(1, case.num_fit // 10))
    out: dict = {"case": asdict(case), "rows": []}

    def record(what: str, timing, reference, peak: int | None = None) -> None:
        out["rows"].append({"what": what, "wall": timing.wall, "cpu": timing.cpu, "ref_wall": reference.wall,
                            "ref_cpu": reference.cpu, "contended": timing.contended or reference.contended, "peak": peak})

    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=max(5, case.repeats))
        plain_fit = measure(lambda: model(train_x), repeats=max(5, case.repeats))
    record(f"plain head forward, N={case.num_predict:,}", plain, plain)

    if case.method == "laplace":
        if case.fit:
            fixed = measure(lambda: posthoc.wrap(model, method="laplace", hessian="kron", prior_precision=1.0)
                            .fit(loader, progress=False), repeats=1, warmup=0)
            record(f"fit, prior 1.0 (N={case.num_fit:,})", fixed, plain_fit)
        um = posthoc.wrap(model, method="laplace", hessian="kron", prior_precision="marglik")
        fit = measure(lambda: um.fit(loader, progress=False), repeats=1, warmup=0)
        if case.fit:
            record(f"fit + marglik (N={case.num_fit:,})", fit, plain_fit)
        out["prior_precision"] = float(um.method.prior_precision)
        models = {"probit": um}
        if "mc" in case.predicts:
            mc = posthoc.wrap(model, method="laplace", hessian="kron", prior_precision="marglik", link="mc", num_samples=SAMPLES)
            mc.method.load_posterior_state(um.method.posterior_state())
            mc.method.fitted.fill_(True)
            models["mc"] = mc
        calls = {name: (lambda um=models[name]: um.predict(x, keep_samples=False, max_memory=case.max_memory))
                 for name in case.predicts}
        names = {"probit": "predict probit", "mc": f"predict MC S={SAMPLES}"}
    else:
        if case.method == "swag":
            um = posthoc.wrap(model, method="swag", subset="last_layer")
            fit = measure(lambda: um.fit(loader, progress=False, epochs=1, lr=1e-3, collect_per_epoch=5), repeats=1, warmup=0)
            if case.fit:
                record(f"fit, 1 epoch SGD lr 1e-3, 5 snapshots (N={case.num_fit:,})", fit, plain_fit)
        else:
            um = posthoc.wrap(model, method="mc-dropout", where="head", p=0.1)
        samples = {name: int(name.split("=")[1]) for name in case.predicts}
        calls = {name: (lambda s=samples[name]: um.predict(x, num_samples=s, keep_samples=False, max_memory=case.max_memory))
                 for name in case.predicts}
        names = {name: f"predict {name}" for name in case.predicts}

    previous = posthoc.settings.max_memory
    if case.settings_memory is not None:
        posthoc.settings.max_memory = case.settings_memory
    try:
        for name, call in calls.items():
            peak = peak_growth(call)  # also the warm-up
            timing = measure(call, repeats=case.repeats, warmup=0)
            record(names[name], timing, plain, peak)
    finally:
        posthoc.settings.max_memory = previous
    # outputs of one streamed predict: probs (N, C) float32 + entropy/aleatoric/epistemic/confidence (N,) + label int64
    out["output_bytes"] = case.num_predict * (4 * case.classes + 4 * 4 + 8)
    out["input_bytes"] = case.num_predict * case.width * 4
    out["threads"] = torch.get_num_threads()
    return out


# ----------------------------------------------------------------------------- parent side
def launch(case: Case, timeout: float = 300.0) -> dict:
    """Run ``case`` in a fresh interpreter; re-run it once if a timing was contended."""
    result: dict = {}
    for attempt in range(2):
        command = [sys.executable, __file__, "--case", json.dumps(asdict(case))]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **CHILD_ENV})
        except subprocess.TimeoutExpired:
            return {"case": asdict(case), "error": f"timed out after {timeout:.0f} s", "rows": []}
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return {"case": asdict(case), "error": lines[-1] if lines else f"exit {done.returncode}", "rows": []}
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["attempts"] = attempt + 1
        if not any(r["contended"] for r in result["rows"]):
            break
    return result


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MiB:,.0f}"


def _flag(row: dict) -> str:
    return " (contended)" if row["contended"] else ""


def print_rows(results: list[dict], budget: int | None = None) -> None:
    """One Markdown row per timed step: seconds, ratio to the plain forward (wall and CPU), peak memory."""
    print("| method | shape | what | wall s | x plain (wall) | x plain (cpu) | cpu/wall | µs / example | "
          "peak RSS growth MiB | outputs MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        case = result["case"]
        shape = f"N={case['num_predict']:,} D={case['width']:,} C={case['classes']:,}"
        if "error" in result:
            print(f"| {case['method']} | {shape} | FAILED: {result['error']} | | | | | | | |")
            continue
        for row in result["rows"]:
            per_example = case["num_fit"] if row["what"].startswith("fit") else case["num_predict"]
            peak = row["peak"]
            print(f"| {case['label'] or case['method']} | {shape} | {row['what']} | {row['wall']:.3f} | "
                  f"{row['wall'] / row['ref_wall']:.1f}x | {row['cpu'] / row['ref_cpu']:.1f}x | "
                  f"{row['cpu'] / row['wall']:.2f}{_flag(row)} | {1e6 * row['wall'] / per_example:.1f} | "
                  f"{_mib(peak)} | {_mib(result['output_bytes']) if peak is not None else ''} |")


def main_shape(repeats: int = 1) -> list[dict]:
    shape = dict(num_fit=5000, num_predict=5000, width=2048, classes=1000, repeats=repeats)
    return [
        launch(Case("laplace", predicts=["probit", "mc"], label="LLLA kron", **shape)),
        launch(Case("swag", predicts=[f"S={SAMPLES}"], label="last-layer SWAG", **shape)),
        launch(Case("mc-dropout", predicts=[f"S={SAMPLES}"], fit=False, label="head MC dropout", **shape)),
    ]


def cases_for(shape: dict, fit: bool = True) -> list[Case]:
    return [
        Case("laplace", predicts=["probit", "mc"], label="LLLA kron", fit=fit, **shape),
        Case("swag", predicts=[f"S={SAMPLES}"], label="last-layer SWAG", fit=fit, **shape),
        Case("mc-dropout", predicts=[f"S={SAMPLES}"], fit=False, label="head MC dropout", **shape),
    ]


def part_main() -> None:
    print("\n### Main shape: N=5,000, D=2,048, C=1,000 (fit on the same 5,000; default max_memory 512 MiB)\n")
    print_rows(main_shape())


def part_growth() -> None:
    print("\n### Growth in C (N=5,000, D=2,048; C=1,000 is the main table)\n")
    results = []
    for classes in (10, 100):
        results += [launch(case) for case in cases_for(dict(num_fit=5000, num_predict=5000, width=2048, classes=classes, repeats=3))]
    print_rows(results)

    print("\n### Growth in N (D=512, C=100; fit on min(N, 10k); predict on N)\n")
    results = []
    for num in (1000, 10_000, 100_000):
        shape = dict(num_fit=min(num, 10_000), num_predict=num, width=512, classes=100, repeats=3 if num <= 10_000 else 1)
        results += [launch(case) for case in cases_for(shape, fit=num <= 10_000)]
    print_rows(results)

    print(f"\n### MC overhead vs D (N=5,000, C=100): S={SAMPLES} predict minus the deterministic (probit) / S=1 predict\n")
    print("| method | D | base predict | base s | S=100 s | MC overhead s | overhead ns / (example x sample x class) | cpu/wall |")
    print("|---|---|---|---|---|---|---|---|")
    for width in (256, 2048):
        shape = dict(num_fit=5000, num_predict=5000, width=width, classes=100, repeats=5, fit=False)
        for case in (Case("laplace", predicts=["probit", "mc"], label="LLLA kron", **shape),
                     Case("swag", predicts=["S=1", f"S={SAMPLES}"], label="last-layer SWAG", **shape),
                     Case("mc-dropout", predicts=["S=1", f"S={SAMPLES}"], label="head MC dropout", **shape)):
            result = launch(case)
            if "error" in result:
                print(f"| {case.label} | {width} | FAILED: {result['error']} | | | | | |")
                continue
            base, sampled = result["rows"][-2], result["rows"][-1]
            overhead = sampled["wall"] - base["wall"]
            flag = _flag(base) or _flag(sampled)
            print(f"| {case.label} | {width:,} | {base['what']} | {base['wall']:.3f} | {sampled['wall']:.3f} | "
                  f"{overhead:.3f} | {1e9 * overhead / (5000 * SAMPLES * 100):.2f} | "
                  f"{min(base['cpu'] / base['wall'], sampled['cpu'] / sampled['wall']):.2f}{flag} |")


def part_budget() -> None:
    print("\n### Memory budget: main-shape MC predict (S=100) under max_memory\n")
    print("| method | budget | set through | wall s | x plain (wall) | cpu/wall | peak RSS growth MiB | outputs MiB | "
          "growth - outputs MiB | within budget + outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    shape = dict(num_fit=5000, num_predict=5000, width=2048, classes=1000, repeats=1, fit=False)
    for budget, through in ((64 * MiB, "predict(max_memory=)"), (2**30, "posthoc.settings.max_memory")):
        memory = {"max_memory": budget} if through.startswith("predict") else {"settings_memory": budget}
        for case in (Case("laplace", predicts=["mc"], label="LLLA kron", **shape, **memory),
                     Case("swag", predicts=[f"S={SAMPLES}"], label="last-layer SWAG", **shape, **memory),
                     Case("mc-dropout", predicts=[f"S={SAMPLES}"], label="head MC dropout", **shape, **memory)):
            result = launch(case)
            if "error" in result:
                print(f"| {case.label} | {_mib(budget)} MiB | {through} | FAILED: {result['error']} | | | | | | |")
                continue
            row = result["rows"][-1]
            outputs = result["output_bytes"]
            ok = "yes" if row["peak"] <= budget + outputs else f"NO ({row['peak'] / (budget + outputs):.1f}x)"
            print(f"| {case.label} | {_mib(budget)} MiB | {through} | {row['wall']:.3f} | "
                  f"{row['wall'] / row['ref_wall']:.1f}x | {row['cpu'] / row['wall']:.2f}{_flag(row)} | "
                  f"{_mib(row['peak'])} | {_mib(outputs)} | {_mib(row['peak'] - outputs)} | {ok} |")


PARTS = {"main": part_main, "growth": part_growth, "budget": part_budget}

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(run_case(Case(**json.loads(sys.argv[2])))))
        sys.exit(0)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"S={SAMPLES}; every case in a fresh process; contended cases re-run once")
    for part in sys.argv[1:] or list(PARTS):
        PARTS[part]()
