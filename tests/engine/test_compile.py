"""torch.compile: the sampling kernels trace as one graph, and a compiled model can be wrapped.

``backend="eager"`` runs Dynamo's tracing (where graph breaks are found) without code generation,
so these checks are cheap; ``benchmarks/bench_compile.py`` times real compilation.
"""

from __future__ import annotations

import pytest
import torch

import posthoc
from posthoc.core.prediction import Prediction
from posthoc.methods.laplace.glm_predictive import LogitGaussian, bridge_log_probs, mc_log_probs, probit_log_probs
from posthoc.methods.laplace.kron import KronCurvature
from posthoc_apps.demo import zoo


def _gaussian(rows: int = 7, classes: int = 5) -> LogitGaussian:
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(classes, classes, generator=generator))[0]
    return LogitGaussian(
        torch.randn(rows, classes, generator=generator), torch.rand(rows, classes, generator=generator), basis
    )


@pytest.mark.parametrize(
    "kernel",
    [
        probit_log_probs,
        bridge_log_probs,
        lambda g: mc_log_probs(g, 10),
        lambda g: Prediction.from_log_probs(*mc_log_probs(g, 10)),
    ],
    ids=["probit", "bridge", "mc", "mc-to-prediction"],
)
def test_logit_space_kernels_compile_without_graph_breaks(kernel) -> None:
    torch._dynamo.reset()
    g = _gaussian()
    compiled = torch.compile(kernel, fullgraph=True, backend="eager")  # raises on any graph break
    torch.manual_seed(0)
    expected = kernel(g)
    torch.manual_seed(0)
    got = compiled(g)
    for a, b in zip(_tensors(got), _tensors(expected)):
        torch.testing.assert_close(a, b)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, Prediction):
        return [out.probs, out.entropy, out.aleatoric, out.epistemic, out.samples]
    return list(out) if isinstance(out, tuple) else [out]


def test_kron_logit_gaussian_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    phi, mean = torch.randn(6, 4, generator=generator), torch.randn(6, 3, generator=generator)
    in_vecs, out_vecs = (
        torch.linalg.qr(torch.randn(4, 4, generator=generator))[0],
        torch.linalg.qr(torch.randn(3, 3, generator=generator))[0],
    )
    block = KronCurvature()
    block.out_eigvals, block.out_eigvecs, block.in_eigvals, block.in_eigvecs = (
        torch.rand(3) + 0.1,
        out_vecs,
        torch.rand(4) + 0.1,
        in_vecs,
    )
    got = torch.compile(block.head_variance, fullgraph=True, backend="eager")(phi, mean, 2.0)
    torch.testing.assert_close(got.scale, block.head_variance(phi, mean, 2.0).scale)


@pytest.mark.parametrize("method", ["laplace", "mc-dropout", "temperature", "ibnn"])
def test_a_compiled_model_is_wrapped_through_its_original_module(method, digits, tmp_path) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x, y = digits.fit.tensors[:2]
    loader = [(x[:128], y[:128])]
    test_x = digits.test.tensors[0][:32]
    original = zoo.pretrained()
    compiled = torch.compile(zoo.pretrained(), backend="eager")
    predictions = []
    for model in (original, compiled):
        torch.manual_seed(0)  # iBNN's fit draws from the global generator
        um = posthoc.wrap(model, method=method).fit(loader, loader, progress=False)
        predictions.append(um.predict(test_x, generator=torch.Generator().manual_seed(0)).probs)
    torch.testing.assert_close(predictions[1], predictions[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0, "posthoc's hooks must not trigger compilation"
    um.save(tmp_path / "posterior.pt")  # fitted on the compiled model: loads onto the plain one, and back
    for model in (original, torch.compile(original, backend="eager")):
        reloaded = posthoc.load(tmp_path / "posterior.pt", model)
        torch.testing.assert_close(
            reloaded.predict(test_x, generator=torch.Generator().manual_seed(0)).probs, predictions[1]
        )
