"""``um.to_module()`` and ``calibrator.to_module()``: the fitted predictive as a plain module, exported and served.

Equality: the module, and the program ``torch.export`` makes of it, give ``um.predict(x)``'s probabilities to 1e-5
(float16 networks: 1e-4) for every deterministic predictive, on the bundled digits CNN, a random timm ResNet and a
random tiny BERT. Predictives exported with samples fixed at export agree with ``um.predict`` in distribution
(exactly for MC dropout with shared masks and the same seed). Methods that sample the network itself are refused
with an :class:`~posthoc.ExportError`. The saved program runs in a process that never imports posthoc, and ONNX
Runtime runs the ONNX exports.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import onnxruntime
import pytest
import timm
import torch
from conftest import linear_data_regressor
from torch import nn

import posthoc
from posthoc_apps.demo import hf, zoo

#: what the exported program may differ from ``um.predict`` by (float32 networks; float16: FP16_ATOL)
ATOL, FP16_ATOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small models: one thread each (the conftest fixture)."""


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _exported(module: nn.Module, x) -> nn.Module:
    return torch.export.export(module, (x,)).module()


def _assert_exports(um: posthoc.UncertainModel, x, atol: float = ATOL) -> nn.Module:
    """The module and its exported program both give ``um.predict(x).probs`` to ``atol``; returns the module."""
    expected = um.predict(x).probs
    module = um.to_module()
    torch.testing.assert_close(module(x), expected, atol=atol, rtol=0)
    torch.testing.assert_close(_exported(module, x)(x), expected, atol=atol, rtol=0)
    return module


def erring_cnn() -> nn.Module:
    """The bundled CNN with noise on its convolutions and its logits times 3: it misclassifies ~34 of the 256 held-out
    digits, overconfidently, so that the held-out choices pick a fitted map (the bundled CNN misclassifies too few
    of them for a calibrator to beat its own probabilities)."""
    model = zoo.pretrained()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.features.parameters():
            parameter.add_(0.6 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        model.classifier[4].weight.mul_(3)
        model.classifier[4].bias.mul_(3)
    return model


def _fit(method, small, model=None, tolerance=None, **options) -> posthoc.UncertainModel:
    um = posthoc.wrap(erring_cnn() if model is None else model, method=method, **options)
    return um.fit(small["fit"], small["val"], progress=False, shift=None, tolerance=tolerance)


# ------------------------------------------------------------------------------------------ the digits CNN
DETERMINISTIC = {
    "none": ("none", {}),
    "temperature": ("temperature", {}),
    "vector": (["none", "vector"], {}),
    "matrix": (["none", "matrix"], {}),
    "dirichlet": (["none", "dirichlet"], {}),
    "ets": (["none", "ets"], {}),
    "histogram": (["none", "histogram"], {}),
    "isotonic": (["none", "isotonic"], {}),
    "auto-calibration": ("auto-calibration", {"candidates": ["temperature", "vector"]}),
    "laplace kron": ("laplace", {}),
    "laplace diag": ("laplace", {"hessian": "diag"}),
    "laplace full": ("laplace", {"hessian": "full"}),
    "laplace bridge": ("laplace", {"link": "bridge"}),
    "laplace+temperature": (["laplace", "temperature"], {}),
    "laplace+dac": (["laplace", "dac"], {}),
    # the guard off: without perturbed copies the last configuration (weights as fitted) wins, so that the export of a
    # density-aware temperature is checked (the guarded clean choice on these digits is T0 alone)
    "none+dac": (["none", "dac"], {"tolerance": math.inf}),
}


#: stacked calibrators that the held-out choice keeps on this data (matrix, Dirichlet and isotonic stay the identity
#: on 256 digits; their fitted maps are exported in test_calibrators_export_from_logits_to_probabilities)
CHOSEN_MAPS = ("temperature", "vector", "ets", "histogram", "auto-calibration")


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_deterministic_predictives_export_equal_to_predict(name, small) -> None:
    method, options = DETERMINISTIC[name]
    um = _fit(method, small, **options)
    if name in CHOSEN_MAPS:
        assert not bool(um.method.calibrator.passthrough)  # a fitted map is exported, not the identity
    if name.endswith("dac"):
        assert float(um.method.weights.max()) > 0.1  # a density-aware temperature, not T0 alone
    _assert_exports(um, small["x"][:16])


def test_torch_compile_traces_the_module_in_one_graph(small) -> None:
    um = _fit(["laplace", "dac"], small)
    x = small["x"][:16]
    explained = torch._dynamo.explain(um.to_module())(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(um.to_module(), backend="aot_eager")
    torch.testing.assert_close(compiled(x), um.predict(x).probs, atol=ATOL, rtol=0)


def test_ensembles_and_auto_export_equal_to_predict(small) -> None:
    torch.manual_seed(0)
    other = erring_cnn()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    x = small["x"][:16]
    ensemble = posthoc.wrap([erring_cnn(), other], method=["laplace", "temperature"])
    module = _assert_exports(ensemble.fit(small["fit"], small["val"], progress=False, shift=None), x)
    assert len(module.predictive.inner.members) == 2
    with_dac = posthoc.wrap([erring_cnn(), other], method=["none", "dac"])
    _assert_exports(with_dac.fit(small["fit"], small["val"], progress=False, shift=None), x)
    auto = _fit("auto", small, candidates=["none", "temperature"])
    _assert_exports(auto, x)


def test_float16_network_exports_to_1e_4(small) -> None:
    fit = [(x.half(), y) for x, y in small["fit"]][:2]
    val = [(x.half(), y) for x, y in small["val"]]
    x = small["x"][:16].half()
    for method in ("temperature", "laplace"):
        um = posthoc.wrap(zoo.pretrained().half(), method=method).fit(fit, val, progress=False, shift=None)
        module = _assert_exports(um, x, atol=FP16_ATOL)
        assert module(x).dtype == torch.float32


def test_exported_program_takes_any_batch_size(small) -> None:
    um = _fit(["laplace", "dac"], small)
    x = small["x"][:16]
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(um.to_module(), (x,), dynamic_shapes=({0: batch},)).module()
    for rows in (1, 5, 40):
        torch.testing.assert_close(program(small["x"][:rows]), um.predict(small["x"][:rows]).probs, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ fixed samples
@pytest.mark.xfail(
    strict=True,
    reason="known regression of the feature store's merge: a stage stacked on shared-mask MC dropout exports a "
    "module that differs from its seeded predict (up to 0.14); CHANGELOG, Known issues",
)
@pytest.mark.parametrize("stacked", ["temperature", "dac"])
def test_mc_dropout_with_shared_masks_exports_exactly_its_seeded_predict(stacked, small) -> None:
    um = _fit(["mc-dropout", stacked], small, masks="shared")
    x = small["x"][:8]  # one chunk of predict: one set of masks, as the module's
    expected = um.predict(x, generator=torch.Generator().manual_seed(3)).probs
    module = um.to_module(seed=3)
    torch.testing.assert_close(_exported(module, x)(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "method, options",
    [
        ("mc-dropout", {"p": 0.25}),
        ("swag", {"subset": "last_layer", "epochs": 2}),
        ("laplace", {"link": "mc"}),
        ("vi", {"epochs": 1}),
    ],
    ids=["mc-dropout", "last-layer swag", "laplace mc", "vi at the head"],
)
def test_sampled_predictives_export_with_fixed_draws_that_match_predict_in_distribution(method, options, small) -> None:
    epochs = options.pop("epochs", None)
    um = posthoc.wrap(zoo.pretrained(), method=method, **options)
    um.fit(small["fit"], small["val"], progress=False, shift=None, **({"epochs": epochs} if epochs else {}))
    x = small["x"][:8]
    samples = 4000
    module = um.to_module(num_samples=samples, seed=1)
    program = _exported(module, x)
    out = program(x)
    # fixed draws: the same output twice, and an input's output does not depend on the rest of its batch
    torch.testing.assert_close(program(x), out, atol=0, rtol=0)
    torch.testing.assert_close(module(x[:3]), out[:3], atol=1e-6, rtol=0)
    # two Monte Carlo estimates of 4,000 draws each: their difference has a std below 0.5 * sqrt(2 / 4000) = 0.011
    expected = um.predict(x, num_samples=samples, generator=torch.Generator().manual_seed(2)).probs
    assert float((out - expected).abs().max()) < 0.04


# ------------------------------------------------------------------------------------------ refusals
REFUSED = {
    "swag over the network": ("swag", {}, "samples whole networks"),
    "laplace over layers": ("laplace", {"subset": ["classifier.1"]}, "linearises the whole network"),
    "vi over layers": ("vi", {"layers": "all"}, "samples are networks"),
    "ibnn": ("ibnn", {}, "samples are networks"),
    "ivon": ("ivon", {}, "samples are networks"),
    "sgld": ("sgld", {}, "samples are networks"),
    "sparse-vd": ("sparse-vd", {}, "samples are networks"),
    "dac on swag": (["swag", "dac"], {}, "'swag'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_methods_that_sample_the_network_are_refused_before_fit(name) -> None:
    method, options, why = REFUSED[name]
    um = posthoc.wrap(zoo.pretrained(), method=method, **options)
    with pytest.raises(posthoc.ExportError, match=why) as caught:
        um.to_module()
    assert "um.predict" in str(caught.value)  # says what to do instead


def test_mc_dropout_at_several_sites_and_full_bridge_are_refused(small) -> None:
    um = posthoc.wrap(zoo.pretrained(), method="mc-dropout", where="blocks", p=0.1)
    um.predict(small["x"][:2])  # finds its sites
    with pytest.raises(posthoc.ExportError, match="where='head'"):
        um.to_module()
    with pytest.raises(posthoc.ExportError, match="link='probit'"):
        _fit("laplace", small, hessian="full", link="bridge", prior_precision=1.0).to_module()
    with pytest.raises(posthoc.NotFittedError):
        posthoc.wrap(zoo.pretrained(), method="laplace").to_module()


# ------------------------------------------------------------------------------------------ other networks
def test_timm_resnet_exports_equal_to_predict(one_thread) -> None:
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4).eval()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 4, (32,))
    loader = [(x[:16], y[:16]), (x[16:], y[16:])]
    for method in ("laplace", ["laplace", "dac"], ["none", "temperature"]):
        um = posthoc.wrap(model, method=method).fit(loader, loader, progress=False, shift=None)
        _assert_exports(um, x[:6])


def test_hugging_face_classifier_exports_equal_to_predict(one_thread) -> None:
    tokenizer = hf.word_tokenizer()
    batches = hf.text_batches(*hf.keyword_texts(160, seed=0), tokenizer, 40)
    model = hf.tiny_bert().eval()
    x = {key: value for key, value in batches[0].items() if key != "labels"}
    for method in ("laplace", ["laplace", "dac"]):
        um = posthoc.wrap(model, method=method).fit(batches[:2], batches[2:], progress=False, shift=None)
        _assert_exports(um, x)


# ------------------------------------------------------------------------------------------ regression
def test_regressors_export_mean_and_variance() -> None:
    net, x, y = linear_data_regressor(200, 100, 0.1)
    fit = [(x[:50], y[:50]), (x[50:100], y[50:100])]
    val = [(x[100:150], y[100:150])]
    test = x[150:]
    other = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).eval()
    for method, models in [("none", net), ("laplace", net), ("laplace", [net, other])]:
        um = posthoc.wrap(models, method=method, likelihood="regression").fit(fit, val, progress=False)
        expected = um.predict(test)
        module = um.to_module()
        for got in (module(test), _exported(module, test)(test)):
            torch.testing.assert_close(got[0], expected.mean, atol=ATOL, rtol=0)
            torch.testing.assert_close(got[1], expected.variance, atol=ATOL, rtol=1e-5)
    torch.manual_seed(0)
    predicts_noise = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).eval()  # a mean and a log-variance
    um = posthoc.wrap(predicts_noise, method="none", likelihood="heteroscedastic")
    expected, (mean, variance) = um.predict(test), _exported(um.to_module(), test)(test)
    torch.testing.assert_close(mean, expected.mean, atol=ATOL, rtol=0)
    torch.testing.assert_close(variance, expected.variance, atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------------------------------------ posthoc.calibrate
@pytest.mark.parametrize(
    "method", ["temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "identity", "auto"]
)
def test_calibrators_export_from_logits_to_probabilities(method) -> None:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (400,), generator=generator)
    logits = 3 * torch.nn.functional.one_hot(labels, 4) + 2.5 * torch.randn(400, 4, generator=generator)
    calibrator = posthoc.calibrate(logits[:300], labels[:300], method=method)
    if method not in ("identity", "auto"):
        assert not bool(calibrator.passthrough)  # the fitted map is what is exported, not the identity
    module = calibrator.to_module()
    test = logits[300:]
    torch.testing.assert_close(_exported(module, test)(test), calibrator(test), atol=ATOL, rtol=0)


def test_platt_exports_a_binary_classifiers_one_logit() -> None:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (300,), generator=generator)
    scores = 2 * (2 * labels - 1) + 2 * torch.randn(300, generator=generator)
    calibrator = posthoc.calibrate(scores, labels, method="platt")
    module = calibrator.to_module()
    torch.testing.assert_close(_exported(module, scores)(scores), calibrator(scores), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ serving without posthoc
def test_saved_program_runs_in_a_process_that_never_imports_posthoc(small, tmp_path: Path) -> None:
    """The ``torch.export`` program of a loaded posterior runs with torch alone."""
    _fit(["laplace", "dac"], small).save(tmp_path / "posterior.pt")
    um = posthoc.load(tmp_path / "posterior.pt", erring_cnn())
    x = small["x"][:16]
    torch.export.save(torch.export.export(um.to_module(), (x,)), tmp_path / "model.pt2")
    torch.save({"x": x, "probs": um.predict(x).probs}, tmp_path / "check.pt")
    script = textwrap.dedent("""
        import sys, torch
        program = torch.export.load("model.pt2").module()
        check = torch.load("check.pt")
        torch.testing.assert_close(program(check["x"]), check["probs"], atol=1e-5, rtol=0)
        assert not any(name == "posthoc" or name.startswith("posthoc.") for name in sys.modules), "posthoc imported"
        print("served without posthoc")
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "served without posthoc" in done.stdout


# ------------------------------------------------------------------------------------------ ONNX
@pytest.mark.parametrize("name", ["vector", "histogram", "laplace kron", "laplace+dac"])
def test_onnx_runtime_runs_the_torchscript_onnx_export(name, small, tmp_path: Path) -> None:
    method, options = DETERMINISTIC[name]
    um = _fit(method, small, **options)
    module, x = um.to_module(), small["x"][:16]
    path = tmp_path / "model.onnx"
    torch.onnx.export(
        module,
        (x,),
        str(path),
        dynamo=False,
        input_names=["x"],
        output_names=["probs"],
        dynamic_axes={"x": {0: "batch"}, "probs": {0: "batch"}},
    )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": small["x"][:7].numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), um.predict(small["x"][:7]).probs, atol=ATOL, rtol=0)


def test_onnx_runtime_runs_the_dynamo_onnx_export(small, tmp_path: Path) -> None:
    um = _fit("mc-dropout", small, p=0.25, masks="shared")
    x = small["x"][:8]
    path = tmp_path / "model.onnx"
    torch.onnx.export(um.to_module(seed=5), (x,), str(path), dynamo=True, input_names=["x"], output_names=["probs"])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy()})[0]
    expected = um.predict(x, generator=torch.Generator().manual_seed(5)).probs
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=ATOL, rtol=0)


def test_onnx_runtime_runs_calibration_maps(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (400,), generator=generator)
    logits = 3 * torch.nn.functional.one_hot(labels, 4) + 2.5 * torch.randn(400, 4, generator=generator)
    for method in ("matrix", "isotonic", "ets"):
        calibrator = posthoc.calibrate(logits[:300], labels[:300], method=method)
        path = tmp_path / f"{method}.onnx"
        torch.onnx.export(
            calibrator.to_module(),
            (logits[300:],),
            str(path),
            dynamo=False,
            input_names=["logits"],
            dynamic_axes={"logits": {0: "batch"}},
        )
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, {"logits": logits[300:350].numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), calibrator(logits[300:350]), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ each method exports itself
EXPORT_DIR = Path(posthoc.__file__).parent / "export"


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_export_package_knows_no_method_and_reads_no_private_member() -> None:
    """``posthoc/export/`` holds what every method shares: no method (or calibrator, or curvature) named, no class
    dispatch, and no private member read that export/ does not define itself; ``structure ==`` lives in
    ``methods/laplace/`` only."""
    from posthoc.core.method import Method
    from posthoc.methods.calibration.base import Calibrator
    from posthoc.methods.laplace.structure import Curvature

    classes = _subclasses(Method) | _subclasses(Calibrator) | _subclasses(Curvature)
    names = {cls.__name__ for cls in classes} - {"Identity"}  # a calibrator's name that is also a plain word
    assert {"LastLayerLaplace", "PlainModel", "TemperatureCalibrator", "KronCurvature"} <= names
    sources = {path.name: path.read_text() for path in EXPORT_DIR.glob("*.py")}
    for name, source in sources.items():
        mentioned = sorted(word for word in names if re.search(rf"\b{word}\b", source))
        assert not mentioned, f"export/{name} names method classes {mentioned}"
        assert "__mro__" not in source and "__name__" not in source, f"export/{name} dispatches on class names"
    everything = "\n".join(sources.values())
    own = set(re.findall(r"self\.(_\w+)\s*[:=]", everything)) | set(re.findall(r"(?:def|class) (_\w+)", everything))
    for name, source in sources.items():
        private = {attr for attr in re.findall(r"\.(_[a-z]\w*)", source) if not attr.startswith("__")}
        assert private <= own, f"export/{name} reads private members {sorted(private - own)}"
    package = Path(posthoc.__file__).parent
    outside = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "structure ==" in path.read_text() and (package / "methods" / "laplace") not in path.parents
    ]
    assert not outside, f"structure == outside methods/laplace/: {outside}"
