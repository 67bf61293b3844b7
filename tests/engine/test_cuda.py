"""Every method on a CUDA model (skipped without a GPU; CI has none, the device tool runs it).

Checks: the same predictive as on CPU (to float tolerance where nothing random differs), outputs
on the GPU, host synchronisations that do not grow with the number of samples, and inputs, labels
or generators on another device. Half-precision models: tests/engine/test_half_precision.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import posthoc
import posthoc_apps.demo.zoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: name -> (wrap options, fit options, max |Δ probs| against the same fit on CPU)
#: sampling that draws from the caller's CPU generator is comparable; fine-tuning (SWAG, iBNN) draws
#: from device generators whose streams differ from the CPU ones, so for those only the labels are compared
CASES = {
    "none": ({"method": "none"}, {}, 1e-4),
    "temperature": ({"method": "temperature"}, {}, 1e-4),
    "laplace-kron": ({"method": "laplace"}, {}, 1e-4),
    "laplace-full": ({"method": "laplace", "hessian": "full"}, {}, 1e-4),
    "laplace-diag-mc": ({"method": "laplace", "hessian": "diag", "link": "mc", "num_samples": 20}, {}, 1e-3),
    "laplace+temperature": ({"method": ["laplace", "temperature"]}, {}, 1e-4),
    "mc-dropout": ({"method": "mc-dropout", "num_samples": 10}, {}, 1e-3),
    "swag": ({"method": "swag", "num_samples": 4}, {"epochs": 1}, None),
    "swag-last-layer": ({"method": "swag", "subset": "last_layer", "num_samples": 20}, {"epochs": 1}, None),
    "ibnn": ({"method": "ibnn", "num_samples": 2}, {"epochs": 1}, None),
}
#: last-layer / suffix samplers whose host synchronisations must not depend on S
SAMPLERS = {
    "laplace-kron-mc": {"method": "laplace", "link": "mc"},
    "laplace-diag-mc": {"method": "laplace", "hessian": "diag", "link": "mc"},
    "swag-last-layer": {"method": "swag", "subset": "last_layer"},
    "mc-dropout-head": {"method": "mc-dropout", "where": "head"},
}


def _fit_predict(model, small, options, fit_options, device):
    um = posthoc.wrap(model.to(device), **options).fit(small["fit"], small["val"], progress=False, **fit_options)
    return um, um.predict(small["x"].to(device), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_method_on_cuda_matches_cpu(case, digits_model, small):
    options, fit_options, tolerance = CASES[case]
    torch.manual_seed(0)
    _, on_cpu = _fit_predict(posthoc_apps.demo.zoo.pretrained(), small, options, fit_options, "cpu")
    torch.manual_seed(0)
    um, on_gpu = _fit_predict(digits_model, small, options, fit_options, "cuda")
    assert on_gpu.probs.is_cuda and on_gpu.entropy.is_cuda
    assert all(t.device.type == "cuda" for t in um.method.posterior_state().values() if t.numel() > 1)
    torch.testing.assert_close(on_gpu.probs.sum(-1), torch.ones(200, device="cuda"), atol=1e-5, rtol=0)
    if tolerance is None:
        agree = (on_gpu.label.cpu() == on_cpu.label).float().mean()
        assert agree >= 0.95, f"{case}: CPU and CUDA labels agree on {agree:.1%}"
    else:
        torch.testing.assert_close(on_gpu.probs.cpu(), on_cpu.probs, atol=tolerance, rtol=0)


def test_backpack_kfac_on_cuda_matches_cpu(digits_model, small):
    """KFAC over two layers: same spectrum, prior and GLM predictive on both devices (weight draws,
    pred='nn', map the same noise through eigenvector bases that differ between devices, so they are
    not compared)."""
    fitted, probs = [], []
    for model, device in ((posthoc_apps.demo.zoo.pretrained(), "cpu"), (digits_model, "cuda")):
        um = posthoc.wrap(model.to(device), method="laplace", subset=["classifier.1", "classifier.4"])
        fitted.append(um.fit(small["fit"], progress=False).method)
        pred = um.predict(small["x"].to(device))
        assert pred.probs.device.type == device and torch.isfinite(pred.probs).all()
        probs.append(pred.probs.cpu())
    torch.testing.assert_close(probs[1], probs[0], atol=1e-4, rtol=0)
    on_cpu, on_gpu = fitted
    torch.testing.assert_close(
        on_gpu.spectrum().cpu().sort().values, on_cpu.spectrum().sort().values, rtol=1e-3, atol=1e-6
    )
    torch.testing.assert_close(float(on_gpu.prior_precision), float(on_cpu.prior_precision), rtol=1e-3, atol=0)


def _synchronisations(um, x, num_samples: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            um.predict(x, num_samples=num_samples, chunk_size=100, keep_samples=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("case", sorted(SAMPLERS))
def test_sampling_synchronises_with_the_host_per_chunk_not_per_sample(case, digits_model, small):
    um = (
        posthoc.wrap(digits_model.cuda(), **SAMPLERS[case]).fit(small["fit"], progress=False, epochs=1)
        if case.startswith("swag")
        else posthoc.wrap(digits_model.cuda(), **SAMPLERS[case]).fit(small["fit"], progress=False)
    )
    x = small["x"].cuda()
    um.predict(x, num_samples=2)  # warm-up: lazy caches and kernels
    few, many = _synchronisations(um, x, 2), _synchronisations(um, x, 64)
    assert few == many, f"{case}: {few} host synchronisations with S=2, {many} with S=64"
    chunks = 3  # 200 inputs with chunk_size=100: a 64-example probe, then 100 and 36
    assert many <= 8 * chunks, f"{case}: {many} host synchronisations for {chunks} chunks"


def test_inputs_labels_and_generators_on_another_device_are_moved(digits_model, small):
    um = posthoc.wrap(digits_model.cuda(), method="laplace", link="mc", num_samples=8)
    gpu_batches = [(x.cuda(), y.cuda()) for x, y in small["fit"]]
    cpu_labels = [(x.cuda(), y) for x, y in small["fit"]]
    fitted = um.fit(gpu_batches, progress=False).method.posterior_state()
    um.fit(cpu_labels, progress=False)
    for key, value in um.method.posterior_state().items():
        torch.testing.assert_close(value, fitted[key])
    x = small["x"]
    from_cpu = um.predict(x, generator=torch.Generator().manual_seed(3)).probs
    from_gpu = um.predict(x.cuda(), generator=torch.Generator().manual_seed(3)).probs
    assert from_cpu.is_cuda and torch.equal(from_cpu, from_gpu)
    on_device_generator = um.predict(x.cuda(), generator=torch.Generator(device="cuda").manual_seed(3)).probs
    assert on_device_generator.is_cuda and torch.isfinite(on_device_generator).all()


def test_posterior_follows_the_model_to_the_gpu_and_back(tmp_path, digits_model, small):
    um = posthoc.wrap(digits_model, method="laplace").fit(small["fit"], progress=False)
    on_cpu = um.predict(small["x"]).probs
    digits_model.cuda()  # moved after fit: the fitted curvature follows
    on_gpu = um.predict(small["x"]).probs
    assert on_gpu.is_cuda
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=0)
    um.save(tmp_path / "laplace.pt")
    reloaded = posthoc.load(tmp_path / "laplace.pt", posthoc_apps.demo.zoo.pretrained())  # onto a CPU model
    torch.testing.assert_close(reloaded.predict(small["x"]).probs, on_cpu, atol=1e-4, rtol=0)
