"""Temperature scaling: posthoc vs torch-uncertainty's TemperatureScaler vs netcal, same logits.

Fits on the calibration split of the bundled digits with the bundled CNN, then reports the
temperature, the test NLL / ECE, and fit time as a ratio to one plain forward pass over the
calibration data; then the same three fitted on a perfectly separated held-out set (the CNN's
correctly classified calibration digits), where the maximum-likelihood temperature does not exist.
Run: ``python benchmarks/bench_temperature.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from timing import HEADER, measure, row

import posthoc
from posthoc.evaluation import metrics
from posthoc_apps.demo import data, zoo


def main() -> None:
    splits = data.load_digits()
    model = zoo.pretrained()
    cal_loader = data.loader(splits.calibration, batch_size=256)
    x_test, y_test = splits.test.tensors
    x_cal, y_cal = splits.calibration.tensors
    with torch.no_grad():
        cal_logits, test_logits = model(x_cal), model(x_test)

    plain = measure(lambda: [model(x) for x, _ in cal_loader])
    ours_um = posthoc.wrap(model, method="temperature")
    ours_fit = measure(lambda: ours_um.fit(val_loader=cal_loader, progress=False))
    results = {"posthoc": (float(ours_um.method.temperature), ours_um.predict(x_test).probs)}
    timings = {"posthoc": ours_fit}

    try:
        from torch_uncertainty.post_processing import TemperatureScaler
    except ImportError as err:
        print(f"torch-uncertainty not importable ({err}); pip install -e '.[bench]'")
    else:
        scaler = TemperatureScaler(model=model)
        timings["torch-uncertainty"] = measure(lambda: scaler.fit(cal_loader, progress=False))
        with torch.no_grad():
            results["torch-uncertainty"] = (float(scaler.temperature[0]), scaler(x_test).softmax(-1))

    try:
        from netcal.scaling import TemperatureScaling
    except ImportError as err:
        print(f"netcal not importable ({err}); pip install -e '.[bench]'")
    else:
        scaler_nc = TemperatureScaling(detection=False, use_cuda=False)
        cal_probs = cal_logits.softmax(-1).double().numpy()
        timings["netcal (on cached logits)"] = measure(lambda: scaler_nc.fit(cal_probs, y_cal.numpy()), repeats=3)
        probs = torch.as_tensor(np.asarray(scaler_nc.transform(test_logits.softmax(-1).double().numpy())))
        # netcal multiplies logits by a learned weight: its temperature is the inverse of that weight
        weight = float(np.asarray(scaler_nc.temperature).reshape(-1)[0])
        results["netcal (on cached logits)"] = (1.0 / weight, probs)

    calibrator = posthoc.calibrate(cal_logits, y_cal)
    timings["posthoc.calibrate (cached logits)"] = measure(lambda: posthoc.calibrate(cal_logits, y_cal))
    results["posthoc.calibrate (cached logits)"] = (calibrator.temperature, calibrator(test_logits))

    print("| library | T | test NLL | test ECE |\n|---|---|---|---|")
    print(
        f"| MAP (T=1) | 1.0000 | {metrics.nll(test_logits.softmax(-1), y_test):.4f} | {metrics.ece(test_logits.softmax(-1), y_test):.4f} |"
    )
    for name, (temperature, probs) in results.items():
        print(f"| {name} | {temperature:.4f} | {metrics.nll(probs, y_test):.4f} | {metrics.ece(probs, y_test):.4f} |")
    print("\nfit time against one plain forward pass over the calibration split\n" + HEADER)
    print(row("plain forward (calibration split)", plain, plain))
    for name, timing in timings.items():
        print(row(f"fit: {name}", timing, plain))
    separated(cal_logits, y_cal, test_logits, y_test)


def separated(cal_logits: torch.Tensor, y_cal: torch.Tensor, test_logits: torch.Tensor, y_test: torch.Tensor) -> None:
    """Temperatures fitted on the correctly classified calibration digits only, and their test NLL."""
    correct = cal_logits.argmax(-1) == y_cal
    logits, labels = cal_logits[correct], y_cal[correct]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = {"posthoc.calibrate": float(posthoc.calibrate(logits, labels).temperature)}
    try:
        from netcal.scaling import TemperatureScaling
        from torch_uncertainty.post_processing import TemperatureScaler
    except ImportError as err:
        print(f"peers not importable ({err}); pip install -e '.[bench]'")
    else:
        scaler = TemperatureScaler(model=None)
        scaler.fit(
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(logits, labels), batch_size=len(labels)),
            progress=False,
        )
        fitted["torch-uncertainty"] = float(1 / scaler.inv_temp.detach())
        scaler_nc = TemperatureScaling(detection=False, use_cuda=False)
        scaler_nc.fit(logits.softmax(-1).double().numpy(), labels.numpy())
        fitted["netcal"] = 1.0 / float(np.asarray(scaler_nc.temperature).reshape(-1)[0])
    print(f"\nfitted on the {len(labels)} correctly classified calibration digits (perfectly separated)\n")
    print("| library | T | test NLL | test NLL / uncalibrated |\n|---|---|---|---|")
    plain = metrics.nll(test_logits.softmax(-1), y_test)
    for name, temperature in fitted.items():
        nll = metrics.nll((test_logits / temperature).softmax(-1), y_test)
        print(f"| {name} | {temperature:.4f} | {nll:.4f} | {nll / plain:.3f} |")


if __name__ == "__main__":
    main()
