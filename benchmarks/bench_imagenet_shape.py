"""ImageNet-shaped batched sampling on CPU or GPU: last-layer Laplace (KFAC), last-layer SWAG, head MC dropout.

The "model" is a feature-extractor stand-in plus a linear head, ``nn.Sequential(nn.Identity(),
nn.Linear(D, C))``, fed with synthetic features ``phi (N, D)`` (fixed seed; labels drawn from a
random teacher head, the checkpoint is a noisy copy of the teacher), so a plain forward pass is
exactly one head matmul. Every case runs in its own subprocess, which times the plain forward pass
and the method back to back (``benchmarks/timing.py``: medians, ratios, cpu/wall) and measures the
peak resident memory of one ``predict``: the kernel's high-water mark (``VmHWM``) is reset through
``/proc/self/clear_refs`` right before the call, and the growth over the resident size just before
it is reported (on a GPU: ``torch.cuda.max_memory_allocated`` over the allocated memory before
the call). Large allocations are forced to ``mmap`` (``MALLOC_MMAP_THRESHOLD_``) so freed
blocks go back to the kernel and a warm heap does not hide a peak. Predictions stream
(``keep_samples=False``): the outputs are ``(N, C)`` probabilities plus five ``(N,)`` vectors.

Parts:
  main    — N=5,000, D=2,048, C=1,000: fit and predict (probit; MC S=100) as ratios to one head forward.
  growth  — C in {10, 100, 1000} (N=5,000, D=2,048); N in {1k, 10k, 100k} (D=512, C=100; fit on
            at most 10k); MC overhead (S=100 minus the deterministic / S=1 predict) vs D in {256, 2048}.
  budget  — the main-shape MC predict under max_memory = 64 MiB (``predict(max_memory=...)``) and
            1 GiB (``posthoc.settings.max_memory``).
  peer    — last-layer KFAC Laplace next to laplace-torch at D=2,048, C=1,000 (predict on 50 rows).
  backbone — a plain timm ResNet-50 forward pass, the cost the head-only ratios leave out.

Run (about 10 minutes on 2 idle cores)::

    python benchmarks/bench_imagenet_shape.py                 # all parts
    python benchmarks/bench_imagenet_shape.py main budget     # some parts
    python benchmarks/bench_imagenet_shape.py --device cuda   # on a GPU (model and features there)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 2**20
#: S for every sampling predictive
SAMPLES = 100
#: rows per laplace-torch predictive call (4 rows ran out of an 80 GB GPU at the main shape)
PEER_ROWS = 1
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
    device: str = "cpu"


# ----------------------------------------------------------------------------- child side
def _proc_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+)", status.read()).group(1)) * 1024


def peak_growth(fn, device: str) -> int:
    """Bytes the resident set (CPU) or the allocated GPU memory grew by at its peak while ``fn()`` ran."""
    import torch

    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident size
    before = _proc_bytes("VmRSS")
    fn()
    return _proc_bytes("VmHWM") - before


def synthetic(num_fit: int, num_predict: int, width: int, classes: int, device: str = "cpu", seed: int = 0):
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
    model = nn.Sequential(nn.Identity(), head).eval().to(device)
    return model, features[:num_fit].to(device), labels.to(device), features[:num_predict].to(device)


def run_case(case: Case) -> dict:
    """Time fit and predicts of one case against the plain forward; measure each predict's peak RSS."""
    import warnings

    import torch
    from timing import measure
    from torch.utils.data import DataLoader, TensorDataset

    import posthoc

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, train_x, train_y, x = synthetic(case.num_fit, case.num_predict, case.width, case.classes, case.device)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=max(1, case.num_fit // 10))
    out: dict = {"case": asdict(case), "rows": []}

    def record(what: str, timing, reference, peak: int | None = None) -> None:
        # on a GPU the host waits for the device, so a low CPU/wall ratio is no sign of contention
        contended = case.device == "cpu" and (timing.contended or reference.contended)
        out["rows"].append(
            {
                "what": what,
                "wall": timing.wall,
                "cpu": timing.cpu,
                "ref_wall": reference.wall,
                "ref_cpu": reference.cpu,
                "contended": contended,
                "peak": peak,
            }
        )

    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=max(5, case.repeats))
        plain_fit = measure(lambda: model(train_x), repeats=max(5, case.repeats))
    record(f"plain head forward, N={case.num_predict:,}", plain, plain)

    # on a GPU the first call loads kernels and tunes libraries: warm up fits too
    fit_warmup = 0 if case.device == "cpu" else 1
    if case.method == "laplace-torch":
        from laplace import Laplace

        la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
        record(
            f"fit, prior 1.0 (N={case.num_fit:,})",
            measure(lambda: la.fit(loader), repeats=1, warmup=fit_warmup),
            plain_fit,
        )
        la.prior_precision = 1.0
        # its GLM predictive forms (rows, C, C·(D+1)) Jacobians, 8 GB per row at D=2,048, C=1,000,
        # so it is called on PEER_ROWS rows at a time
        calls = {
            name: (
                lambda link=name: torch.cat(
                    [
                        la(x[i : i + PEER_ROWS], pred_type="glm", link_approx=link, n_samples=SAMPLES)
                        for i in range(0, len(x), PEER_ROWS)
                    ]
                )
            )
            for name in case.predicts
        }
        names = {"probit": "predict probit", "mc": f"predict MC S={SAMPLES}"}
    elif case.method == "laplace":
        if case.fit:
            fixed = measure(
                lambda: posthoc.wrap(model, method="laplace", hessian="kron", prior_precision=1.0).fit(
                    loader, progress=False
                ),
                repeats=1,
                warmup=fit_warmup,
            )
            record(f"fit, prior 1.0 (N={case.num_fit:,})", fixed, plain_fit)
        um = posthoc.wrap(model, method="laplace", hessian="kron", prior_precision="marglik")
        fit = measure(lambda: um.fit(loader, progress=False), repeats=1, warmup=fit_warmup)
        if case.fit:
            record(f"fit + marglik (N={case.num_fit:,})", fit, plain_fit)
        out["prior_precision"] = float(um.method.prior_precision)
        models = {"probit": um}
        if "mc" in case.predicts:
            mc = posthoc.wrap(
                model, method="laplace", hessian="kron", prior_precision="marglik", link="mc", num_samples=SAMPLES
            )
            mc.method.load_posterior_state(um.method.posterior_state())
            mc.method.fitted.fill_(True)
            models["mc"] = mc
        calls = {
            name: (lambda um=models[name]: um.predict(x, keep_samples=False, max_memory=case.max_memory))
            for name in case.predicts
        }
        names = {"probit": "predict probit", "mc": f"predict MC S={SAMPLES}"}
    else:
        if case.method == "swag":
            um = posthoc.wrap(model, method="swag", subset="last_layer")
            fit = measure(
                lambda: um.fit(loader, progress=False, epochs=1, lr=1e-3, collect_per_epoch=5),
                repeats=1,
                warmup=fit_warmup,
            )
            if case.fit:
                record(f"fit, 1 epoch SGD lr 1e-3, 5 snapshots (N={case.num_fit:,})", fit, plain_fit)
        else:
            um = posthoc.wrap(model, method="mc-dropout", where="head", p=0.1)
        samples = {name: int(name.split("=")[1]) for name in case.predicts}
        calls = {
            name: (lambda s=samples[name]: um.predict(x, num_samples=s, keep_samples=False, max_memory=case.max_memory))
            for name in case.predicts
        }
        names = {name: f"predict {name}" for name in case.predicts}

    previous = posthoc.settings.max_memory
    if case.settings_memory is not None:
        posthoc.settings.max_memory = case.settings_memory
    try:
        for name, call in calls.items():
            try:
                peak = peak_growth(call, case.device)  # also the warm-up
            except torch.OutOfMemoryError as err:
                out["rows"].append({"what": names[name], "error": str(err).split(". ")[0]})
                continue
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
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **CHILD_ENV}
            )
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


ROWS_HEADER = (
    "| method | shape | what | wall s | x plain (wall) | x plain (cpu) | cpu/wall | µs / example | "
    "peak growth MiB | outputs MiB |\n|---|---|---|---|---|---|---|---|---|---|"
)


def print_rows(result: dict) -> None:
    """One Markdown row per timed step of a case: seconds, ratio to the plain forward (wall and CPU), peak memory."""
    case = result["case"]
    shape = f"N={case['num_predict']:,} D={case['width']:,} C={case['classes']:,}"
    if "error" in result:
        print(f"| {case['label'] or case['method']} | {shape} | FAILED: {result['error']} | | | | | | | |", flush=True)
        return
    for row in result["rows"]:
        if "error" in row:
            print(
                f"| {case['label'] or case['method']} | {shape} | {row['what']}: FAILED: {row['error']} | | | | | | | |",
                flush=True,
            )
            continue
        per_example = case["num_fit"] if row["what"].startswith("fit") else case["num_predict"]
        peak = row["peak"]
        print(
            f"| {case['label'] or case['method']} | {shape} | {row['what']} | {row['wall']:.4f} | "
            f"{row['wall'] / row['ref_wall']:.1f}x | {row['cpu'] / row['ref_cpu']:.1f}x | "
            f"{row['cpu'] / row['wall']:.2f}{_flag(row)} | {1e6 * row['wall'] / per_example:.2f} | "
            f"{_mib(peak)} | {_mib(result['output_bytes']) if peak is not None else ''} |",
            flush=True,
        )


def cases_for(shape: dict, fit: bool = True) -> list[Case]:
    return [
        Case("laplace", predicts=["probit", "mc"], label="LLLA kron", fit=fit, **shape),
        Case("swag", predicts=[f"S={SAMPLES}"], label="last-layer SWAG", fit=fit, **shape),
        Case("mc-dropout", predicts=[f"S={SAMPLES}"], fit=False, label="head MC dropout", **shape),
    ]


def part_main(device: str) -> None:
    print("\n### Main shape: N=5,000, D=2,048, C=1,000 (fit on the same 5,000; default max_memory 512 MiB)\n")
    print(ROWS_HEADER)
    for case in cases_for(
        dict(
            num_fit=5000, num_predict=5000, width=2048, classes=1000, repeats=1 if device == "cpu" else 5, device=device
        )
    ):
        print_rows(launch(case))


def part_growth(device: str) -> None:
    repeats = 3 if device == "cpu" else 5
    print("\n### Growth in C (N=5,000, D=2,048; C=1,000 is the main table)\n")
    print(ROWS_HEADER)
    for classes in (10, 100):
        for case in cases_for(
            dict(num_fit=5000, num_predict=5000, width=2048, classes=classes, repeats=repeats, device=device)
        ):
            print_rows(launch(case))

    print("\n### Growth in N (D=512, C=100; fit on min(N, 10k); predict on N)\n")
    print(ROWS_HEADER)
    for num in (1000, 10_000, 100_000):
        shape = dict(
            num_fit=min(num, 10_000),
            num_predict=num,
            width=512,
            classes=100,
            repeats=repeats if num <= 10_000 else 1,
            device=device,
        )
        for case in cases_for(shape, fit=num <= 10_000):
            print_rows(launch(case))

    print(
        f"\n### MC overhead vs D (N=5,000, C=100): S={SAMPLES} predict minus the deterministic (probit) / S=1 predict\n"
    )
    print(
        "| method | D | base predict | base s | S=100 s | MC overhead s | overhead ns / (example x sample x class) | cpu/wall |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for width in (256, 2048):
        shape = dict(num_fit=5000, num_predict=5000, width=width, classes=100, repeats=5, fit=False, device=device)
        for case in (
            Case("laplace", predicts=["probit", "mc"], label="LLLA kron", **shape),
            Case("swag", predicts=["S=1", f"S={SAMPLES}"], label="last-layer SWAG", **shape),
            Case("mc-dropout", predicts=["S=1", f"S={SAMPLES}"], label="head MC dropout", **shape),
        ):
            result = launch(case)
            if "error" in result:
                print(f"| {case.label} | {width} | FAILED: {result['error']} | | | | | |", flush=True)
                continue
            base, sampled = result["rows"][-2], result["rows"][-1]
            overhead = sampled["wall"] - base["wall"]
            flag = _flag(base) or _flag(sampled)
            print(
                f"| {case.label} | {width:,} | {base['what']} | {base['wall']:.4f} | {sampled['wall']:.4f} | "
                f"{overhead:.4f} | {1e9 * overhead / (5000 * SAMPLES * 100):.3f} | "
                f"{min(base['cpu'] / base['wall'], sampled['cpu'] / sampled['wall']):.2f}{flag} |",
                flush=True,
            )


def part_budget(device: str) -> None:
    print("\n### Memory budget: main-shape MC predict (S=100) under max_memory\n")
    print(
        "| method | budget | set through | wall s | x plain (wall) | cpu/wall | peak growth MiB | outputs MiB | "
        "growth - outputs MiB | within budget + outputs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    shape = dict(num_fit=5000, num_predict=5000, width=2048, classes=1000, repeats=1, fit=False, device=device)
    for budget, through in ((64 * MiB, "predict(max_memory=)"), (2**30, "posthoc.settings.max_memory")):
        memory = {"max_memory": budget} if through.startswith("predict") else {"settings_memory": budget}
        for case in (
            Case("laplace", predicts=["mc"], label="LLLA kron", **shape, **memory),
            Case("swag", predicts=[f"S={SAMPLES}"], label="last-layer SWAG", **shape, **memory),
            Case("mc-dropout", predicts=[f"S={SAMPLES}"], label="head MC dropout", **shape, **memory),
        ):
            result = launch(case)
            if "error" in result:
                print(
                    f"| {case.label} | {_mib(budget)} MiB | {through} | FAILED: {result['error']} | | | | | | |",
                    flush=True,
                )
                continue
            row = result["rows"][-1]
            outputs = result["output_bytes"]
            ok = "yes" if row["peak"] <= budget + outputs else f"NO ({row['peak'] / (budget + outputs):.1f}x)"
            print(
                f"| {case.label} | {_mib(budget)} MiB | {through} | {row['wall']:.4f} | "
                f"{row['wall'] / row['ref_wall']:.1f}x | {row['cpu'] / row['wall']:.2f}{_flag(row)} | "
                f"{_mib(row['peak'])} | {_mib(outputs)} | {_mib(row['peak'] - outputs)} | {ok} |",
                flush=True,
            )


def part_peer(device: str) -> None:
    print(
        f"\n### Next to laplace-torch: last-layer KFAC at D=2,048, C=1,000 (fit on 5,000; predict 50 rows, "
        f"laplace-torch {PEER_ROWS} rows per call)\n"
    )
    print(ROWS_HEADER)
    shape = dict(num_fit=5000, num_predict=50, width=2048, classes=1000, repeats=1, device=device)
    for case in (
        Case("laplace", predicts=["probit", "mc"], label="posthoc LLLA kron", **shape),
        Case("laplace-torch", predicts=["probit", "mc"], label="laplace-torch LLLA kron", **shape),
    ):
        print_rows(launch(case))


def part_backbone(device: str) -> None:
    """What the head-only ratios leave out: one forward pass of a real backbone (timm ResNet-50, random weights)."""
    import timm
    import torch
    from timing import measure

    model = timm.create_model("resnet50", pretrained=False).eval().to(device)
    batch = 256 if device != "cpu" else 16
    x = torch.randn(batch, 3, 224, 224, device=device)
    print("\n### Reference: a plain ResNet-50 forward pass (timm, random weights, 224x224)\n")
    print("| precision | batch | wall s per batch | µs / example | N=5,000 forward s |")
    print("|---|---|---|---|---|")
    precisions = [("float32", None)] + (
        [("bfloat16 autocast, channels_last", torch.bfloat16)] if device != "cpu" else []
    )
    for label, dtype in precisions:
        if dtype is not None:
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        with (
            torch.no_grad(),
            torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=dtype is not None),
        ):
            timing = measure(lambda: model(x), repeats=5 if device != "cpu" else 3)
        print(
            f"| {label} | {batch} | {timing.wall:.4f} | {1e6 * timing.wall / batch:.1f} | {5000 * timing.wall / batch:.2f} |",
            flush=True,
        )


PARTS = {"main": part_main, "growth": part_growth, "budget": part_budget, "peer": part_peer, "backbone": part_backbone}

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(run_case(Case(**json.loads(sys.argv[2])))))
        sys.exit(0)
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"any of {list(PARTS)} (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    where = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        if args.device != "cpu"
        else f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
    )
    print(
        f"{where}; S={SAMPLES}; every case in a fresh process; contended cases re-run once; "
        f"peak growth is {'allocated GPU memory' if args.device != 'cpu' else 'resident CPU memory'}"
    )
    for part in args.parts or list(PARTS):
        if part not in PARTS:
            parser.error(f"unknown part {part!r}; choose from {list(PARTS)}")
        PARTS[part](args.device)
