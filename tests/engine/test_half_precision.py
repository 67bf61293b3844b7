"""float16 / bfloat16 models: posteriors stay in float32 or float64, probabilities come out in float32
and close to the float32 model's. On CPU always, and on CUDA where a GPU is present."""

from __future__ import annotations

import pytest
import torch

import posthoc
from posthoc_apps.demo import zoo

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = {
    "laplace-kron": ({"method": "laplace"}, {}),
    "laplace-diag-mc": ({"method": "laplace", "hessian": "diag", "link": "mc", "num_samples": 20}, {}),
    "temperature": ({"method": "temperature"}, {}),
    "swag-last-layer": ({"method": "swag", "subset": "last_layer", "num_samples": 20}, {"epochs": 1}),
    "mc-dropout": ({"method": "mc-dropout", "num_samples": 10}, {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_half_precision_models_keep_float32_posteriors(case, dtype, device, small):
    options, fit_options = CASES[case]
    torch.manual_seed(0)
    reference = posthoc.wrap(zoo.pretrained().to(device), **options).fit(
        small["fit"], small["val"], progress=False, **fit_options
    )
    half = [(x.to(dtype), y) for x, y in small["fit"]], [(x.to(dtype), y) for x, y in small["val"]]
    torch.manual_seed(0)
    um = posthoc.wrap(zoo.pretrained().to(device, dtype), **options).fit(*half, progress=False, **fit_options)
    for name, value in um.method.posterior_state().items():
        if value.is_floating_point() and not name.startswith("model."):
            assert value.dtype in (torch.float32, torch.float64), f"{case}: {name} is {value.dtype}"
    x = small["x"].to(device)
    generator = torch.Generator(device=device)
    got = um.predict(x.to(dtype), generator=generator.manual_seed(0)).probs
    expected = reference.predict(x, generator=generator.manual_seed(0)).probs
    assert got.dtype == torch.float32
    assert (got - expected).abs().mean() < 0.02, f"{case} in {dtype}: mean |Δp| {(got - expected).abs().mean():.4f}"
