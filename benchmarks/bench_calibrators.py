"""Every posthoc calibrator next to netcal and torch-uncertainty, on the same saved logits.

The bundled digits CNN (or ``--model digits_bn_cnn``) computes its logits once: the calibration
split (600 digits) to fit on, the test split (1,000) rotated 0, 45 and 90 degrees to evaluate on.
Each calibrator is fitted on the calibration logits only (no model in the loop), and the table shows
test NLL / ECE per rotation and the median fit time (wall and process CPU seconds, 3 repeats, one
torch thread by default).
``--scale 3`` multiplies every logit by 3 first (an overconfident model).
Run: ``python benchmarks/bench_calibrators.py [--model digits_cnn] [--scale 1]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from timing import measure
from torch import Tensor

import posthoc
from posthoc.evaluation import metrics
from posthoc_apps.demo import data, zoo

ROTATIONS = (0, 45, 90)
OURS = (
    "identity",
    "temperature",
    "vector",
    "matrix",
    "dirichlet",
    "ets",
    "histogram",
    "isotonic",
    "venn-abers",
    "auto",
)

#: fit(cal_logits, cal_labels) -> predict(test_logits) -> probabilities
Fitter = Callable[[Tensor, Tensor], Callable[[Tensor], Tensor]]


def ours(method: str, tolerance: float | None = None) -> Fitter:
    def fit(logits: Tensor, labels: Tensor) -> Callable[[Tensor], Tensor]:
        return posthoc.calibrate(logits, labels, method=method, tolerance=tolerance)

    return fit


def netcal(factory: Callable[[], object]) -> Fitter:
    """netcal works on probabilities (numpy, float64)."""

    def fit(logits: Tensor, labels: Tensor) -> Callable[[Tensor], Tensor]:
        calibrator = factory()
        calibrator.fit(logits.softmax(-1).double().numpy(), labels.numpy())
        return lambda z: torch.as_tensor(np.asarray(calibrator.transform(z.softmax(-1).double().numpy())))

    return fit


def torch_uncertainty(factory: Callable[[], torch.nn.Module]) -> Fitter:
    """torch-uncertainty scalers fit on a loader of (logits, labels) when given no model."""

    def fit(logits: Tensor, labels: Tensor) -> Callable[[Tensor], Tensor]:
        scaler = factory()
        scaler.fit(
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(logits, labels), batch_size=len(labels)),
            progress=False,
        )

        def predict(z: Tensor) -> Tensor:
            with torch.no_grad():
                out = scaler(z)
            # the binning scalers return probabilities, the logit scalers logits
            return (
                out
                if torch.allclose(out.sum(-1), torch.ones(len(out)), atol=1e-4) and out.min() >= 0
                else out.softmax(-1)
            )

        return predict

    return fit


def peers(num_classes: int) -> dict[str, Fitter]:
    found: dict[str, Fitter] = {}
    try:
        from netcal.binning import ENIR, HistogramBinning, IsotonicRegression
        from netcal.scaling import LogisticCalibration, TemperatureScaling
    except ImportError as err:
        print(f"netcal not importable ({err}); pip install -e '.[bench]'")
    else:
        found["netcal TemperatureScaling"] = netcal(lambda: TemperatureScaling(detection=False, use_cuda=False))
        found["netcal LogisticCalibration (vector)"] = netcal(
            lambda: LogisticCalibration(detection=False, use_cuda=False)
        )
        found["netcal HistogramBinning"] = netcal(lambda: HistogramBinning(bins=15))
        found["netcal IsotonicRegression"] = netcal(IsotonicRegression)
        found["netcal ENIR"] = netcal(ENIR)
    try:
        from torch_uncertainty import post_processing as tu
    except ImportError as err:
        print(f"torch-uncertainty not importable ({err}); pip install -e '.[bench]'")
    else:
        found["torch-uncertainty TemperatureScaler"] = torch_uncertainty(lambda: tu.TemperatureScaler(model=None))
        found["torch-uncertainty VectorScaler"] = torch_uncertainty(lambda: tu.VectorScaler(num_classes, model=None))
        found["torch-uncertainty MatrixScaler"] = torch_uncertainty(lambda: tu.MatrixScaler(num_classes, model=None))
        found["torch-uncertainty DirichletScaler"] = torch_uncertainty(
            lambda: tu.DirichletScaler(num_classes, model=None)
        )
        found["torch-uncertainty HistogramBinningScaler"] = torch_uncertainty(
            lambda: tu.HistogramBinningScaler(model=None)
        )
        found["torch-uncertainty IsotonicRegressionScaler"] = torch_uncertainty(
            lambda: tu.IsotonicRegressionScaler(model=None)
        )
    try:
        from mapie._venn_abers import predict_proba_prefitted_va
    except ImportError as err:
        print(f"MAPIE not importable ({err}); pip install -e '.[test]'")
    else:

        def mapie_venn_abers(logits: Tensor, labels: Tensor) -> Callable[[Tensor], Tensor]:
            held_out = (logits.softmax(-1).double().numpy(), labels.numpy())
            return lambda z: torch.as_tensor(
                predict_proba_prefitted_va(*held_out, z.softmax(-1).double().numpy(), va_tpe="one_vs_all")[0]
            )

        found["MAPIE Venn-Abers (one vs all)"] = mapie_venn_abers
    return found


def saved_logits(name: str, scale: float) -> dict[str, tuple[Tensor, Tensor]]:
    splits = data.load_digits()
    model = zoo.pretrained(name)
    sets = {
        "fit": splits.calibration,
        **{f"{deg}°": data.rotated(splits.test, deg) if deg else splits.test for deg in ROTATIONS},
    }
    with torch.no_grad():
        return {key: (model(ds.tensors[0]) * scale, ds.tensors[1]) for key, ds in sets.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="digits_cnn", choices=["digits_cnn", "digits_bn_cnn"])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the logits by this first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the fits are small: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    logits = saved_logits(args.model, args.scale)
    cal_logits, cal_labels = logits["fit"]
    fitters = {f"posthoc {m}": ours(m) for m in OURS}
    fitters["posthoc venn-abers, clean fit (tolerance=inf)"] = ours("venn-abers", math.inf)
    fitters |= peers(cal_logits.shape[-1])
    header = " | ".join(f"NLL / ECE {deg}°" for deg in ROTATIONS)
    print(f"#### {args.model}, logits x{args.scale:g}: fit on {len(cal_labels)} calibration digits, test on 1,000\n")
    print(f"| calibrator | {header} | fit s (wall / cpu) |\n|---|{'---|' * len(ROTATIONS)}---|")
    for name, fitter in fitters.items():
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # netcal's ENIR prints its progress
                timing = measure(lambda: fitter(cal_logits, cal_labels), repeats=3)
                predict = fitter(cal_logits, cal_labels)
            cells = []
            for deg in ROTATIONS:
                test_logits, test_labels = logits[f"{deg}°"]
                probs = predict(test_logits).double().clamp_min(1e-12)
                probs = probs / probs.sum(-1, keepdim=True)
                cells.append(f"{metrics.nll(probs, test_labels):.4f} / {metrics.ece(probs, test_labels):.4f}")
        except Exception as err:  # a peer failing is reported, not fatal
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:80]} |")
            continue
        label = name
        if name == "posthoc auto":
            label = f"posthoc auto (chose {predict.chosen_name})"
        print(f"| {label} | {' | '.join(cells)} | {timing.wall:.3f} / {timing.cpu:.3f} |")


if __name__ == "__main__":
    main()
