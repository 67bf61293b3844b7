"""Chunked prediction, bounded memory on huge inputs, and interrupted fits.

The peak of the per-sample tensors under ``max_memory`` is measured in ``test_memory_budget.py``.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

import posthoc
from posthoc.errors import ConfigError


def test_chunked_predict_equals_one_chunk(digits_model, digits, loaders):
    um = posthoc.wrap(digits_model, method="temperature").fit(val_loader=loaders["calibration"], progress=False)
    x = digits.test.tensors[0][:100]
    whole = um.predict(x, chunk_size=1000)
    chunked = um.predict(x, chunk_size=7)
    for field in ("probs", "entropy", "aleatoric", "epistemic", "confidence", "label"):
        assert torch.allclose(getattr(whole, field).float(), getattr(chunked, field).float(), atol=1e-6), field
    with pytest.raises(ConfigError, match="chunk_size"):
        um.predict(x, chunk_size=0)


def test_dropping_samples_keeps_the_decomposition():
    class Sampler(posthoc.Method):
        name = "test-sampler"
        requires_fit = False

        def log_predictive(self, x, *, num_samples=None, generator=None):
            samples = torch.log_softmax(torch.randn(4, x.shape[0], 3, generator=generator), -1)
            return torch.logsumexp(samples, 0) - torch.log(torch.tensor(4.0)), samples

    from posthoc.engine.uncertain_model import UncertainModel

    um = UncertainModel(Sampler(torch.nn.Linear(2, 3)), [])
    x = torch.zeros(10, 2)
    full = um.predict(x, generator=torch.Generator().manual_seed(0), chunk_size=3)
    lean = um.predict(x, generator=torch.Generator().manual_seed(0), chunk_size=3, keep_samples=False)
    assert full.samples.shape == (4, 10, 3) and lean.samples is None
    assert torch.allclose(full.epistemic, lean.epistemic) and (lean.epistemic > 0).any()


def test_keyboard_interrupt_during_fit_leaves_the_model_untouched(digits_model, digits):
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    digits_model.train()

    def interrupted():
        x, y = digits.calibration.tensors
        yield x[:64], y[:64]
        raise KeyboardInterrupt

    for method in posthoc.available_methods():
        if method == "none":
            continue
        try:  # methods that need no data for fit (e.g. a fixed dropout rate) never see the interrupt
            posthoc.wrap(digits_model, method=method).fit(interrupted(), interrupted(), progress=False)
        except KeyboardInterrupt:
            pass
        after = digits_model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), method
        assert all(m.training for m in digits_model.modules()), method
        assert all(p.requires_grad for p in digits_model.parameters()), method
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in digits_model.modules()), method


SCRIPT = textwrap.dedent("""
    import resource, sys, torch, posthoc
    from posthoc_apps.demo import zoo
    torch.set_num_threads(1)
    model = zoo.pretrained()
    x = torch.randn(40_000, 1, 28, 28)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    um = posthoc.wrap(model, method="none")
    probs = um.predict(x, keep_samples=False).probs
    assert probs.shape == (40_000, 8)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""")


def test_predicting_40k_examples_streams_in_bounded_memory():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip().splitlines()[-1])
    # one forward over all 40k at once would hold >2 GB of activations; chunks of 1,024 stay small
    assert growth < 400 * 2**20, f"peak memory grew by {growth / 2**20:.0f} MiB"
