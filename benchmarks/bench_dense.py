"""Dense outputs: per-pixel NLL, ECE, accuracy, mIoU and the error AUROC of the digit-canvas FCN, plain vs
temperature vs vector vs auto (and a two-member ensemble), in distribution and under two corruptions of posthoc.shift.

The FCN (posthoc_apps.demo.segmentation) is trained on 512 canvases by seed; the methods are fitted on 256 validation
canvases, and measured on 256 test canvases made from digits no fit saw. A corruption is applied to the pixels in
[0, 1] (then normalised as in training); the masks are unchanged (contrast and noise move no pixel).
Run: ``python benchmarks/bench_dense.py [--severity 3] [--fit-shift auto] [--methods none,dac] [--no-ensemble]``
(``--fit-shift auto``: the held-out choices
also see perturbed copies of the validation canvases, ``fit(..., shift="auto")``; the dense default is clean only).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.evaluation.dense import evaluate_dense
from posthoc.shift.kinds import CORRUPTIONS
from posthoc_apps.demo.segmentation import loaders, segmentation_data, trained_fcn

KINDS = ("contrast", "gaussian-noise")
#: the rows: (method, wrap options)
METHODS = {
    "none": ("none", {}),
    "temperature": ("temperature", {}),
    "vector": ("vector", {}),
    "laplace": ("laplace", {}),
    "mc-dropout": ("mc-dropout", {}),
    "dac": ("dac", {}),
    "auto": ("auto", {}),
    "auto (none/temperature/dac)": ("auto", {"candidates": ["none", "temperature", "dac"]}),
}


def corrupted(data: TensorDataset, kind: str, severity: int) -> DataLoader:
    images, masks = data.tensors
    pixels = (images * 0.3 + 0.1).clamp(0, 1)
    shifted = CORRUPTIONS[kind](pixels, severity, torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset((shifted - 0.1) / 0.3, masks), batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--severity", type=int, default=3)
    parser.add_argument(
        "--fit-shift", choices=("none", "auto"), default="none", help="um.fit's shift= (dense default: none)"
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated rows of METHODS")
    parser.add_argument("--no-ensemble", dest="ensemble", action="store_false", help="leave the 2-FCN ensemble out")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    data = segmentation_data()
    begin = time.perf_counter()
    model = trained_fcn(data.train)
    print(f"FCN trained in {time.perf_counter() - begin:.1f} s")
    train, val, test = loaders(data)
    shift = None if args.fit_shift == "none" else args.fit_shift
    models = {}
    for row in args.methods.split(","):
        method, options = METHODS[row]
        begin = time.perf_counter()
        um = posthoc.wrap(model, method=method, dense=True, **options)
        models[row] = um.fit(train, val, shift=shift, progress=False)
        print(f"{row}: fitted in {time.perf_counter() - begin:.1f} s")
        if method == "auto":
            selection = models[row].summary()["posterior"][0]["selection"]
            print(f"{row} chose: {selection['chosen']}")
            for c in selection["candidates"]:
                print(f"  {c['candidate']}: held-out NLL {c['clean_nll']:.4f}, bound {c['bound']:+.5f}")
        if method == "dac":
            card = models[row].summary()["posterior"][-1]
            print(f"{row}: {card['selection']['chosen']}, T0 {card['temperature']:.3f}, weights {card['weights']}")
    if args.ensemble:
        models["ensemble (2 FCNs)"] = posthoc.wrap([model, trained_fcn(data.train, seed=1)], dense=True).fit(
            None, val, progress=False
        )
    print()
    report = evaluate_dense(models, test)
    print(f"### in distribution ({report.positions} valid test pixels)\n\n{report.to_markdown()}\n")
    for kind in KINDS:
        shifted = evaluate_dense(models, corrupted(data.test, kind, args.severity))
        print(f"### {kind}, severity {args.severity}\n\n{shifted.to_markdown()}\n")
    images = data.test.tensors[0]
    with torch.no_grad():
        begin = time.perf_counter()
        model(images)
        plain = time.perf_counter() - begin
    for method in [m for m in ("none", "temperature", "dac") if m in models]:
        begin = time.perf_counter()
        models[method].predict(images)
        print(f"predict {method}: {(time.perf_counter() - begin) / plain:.2f}x a plain forward over 256 canvases")


if __name__ == "__main__":
    main()
