"""Hugging Face classifiers through the same ``wrap``: dict inputs and collator batches, ``ModelOutput``s,
their heads, every method that applies, Laplace over LoRA adapters, and the bad inputs they invite.

Tiny random BERT / ViT configs (hidden size 32, two layers) trained here for a few steps: BERT on the
synthetic keyword task (:mod:`posthoc_apps.demo.hf`), ViT on the bundled digits.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from torch import nn

import posthoc  # noqa: E402
import posthoc_apps.loading.hf  # noqa: E402
from posthoc.core.inputs import split_batch  # noqa: E402
from posthoc.engine.head import FeatureSplit, find_head  # noqa: E402
from posthoc.errors import ConfigError, InputError  # noqa: E402
from posthoc.methods.laplace.curvature import backpack_ggn, lora_parameters  # noqa: E402
from posthoc.methods.laplace.hooked_kfac import hooked_ggn  # noqa: E402
from posthoc.methods.laplace.structure import Curvature  # noqa: E402
from posthoc.methods.laplace.subset_glm import covered_linear_layers, logit_gaussian  # noqa: E402
from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate  # noqa: E402
from posthoc_apps.demo import data, hf  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small models: one thread each (the conftest fixture)."""


@pytest.fixture(scope="module")
def text(one_thread) -> dict:
    tokenizer = hf.word_tokenizer()
    splits = {
        name: hf.keyword_texts(n, seed=seed, **extra)
        for name, n, seed, extra in [
            ("fit", 900, 0, {}),
            ("val", 300, 1, {}),
            ("test", 400, 2, {}),
            ("shift", 400, 3, {"unknown": 0.5}),
        ]
    }
    batches = {name: hf.text_batches(*pair, tokenizer, 100) for name, pair in splits.items()}
    model = hf.train(hf.tiny_bert(), hf.text_batches(*splits["fit"], tokenizer, 32), steps=120)
    return {"tokenizer": tokenizer, "model": model, **batches}


@pytest.fixture(scope="module")
def vit(one_thread, digits: data.DigitsSplits) -> dict:
    fit = hf.rgb(data.subset(digits.fit, 1200))
    model = hf.train(hf.tiny_vit(), data.loader(fit, 32, shuffle=True, seed=0), steps=120)
    test = data.subset(digits.test, 400)
    return {
        "model": model,
        "fit": data.loader(fit, 200),
        "val": data.loader(hf.rgb(digits.calibration), 200),
        "test": data.loader(hf.rgb(test), 200),
        "shift": data.loader(hf.rgb(data.rotated(test, 45)), 200),
    }


def _nll(um: posthoc.UncertainModel, loader) -> float:
    return posthoc.evaluate(um, loader, progress=False).nll


# ------------------------------------------------------------------------------------------ inputs and outputs
def test_collator_batches_batch_encodings_and_model_outputs_go_through(text) -> None:
    encoding = text["tokenizer"](["a great plot", "the boring actor"], padding=True, return_tensors="pt")
    assert not isinstance(encoding, dict)  # a BatchEncoding: a Mapping, not a dict
    x, y = split_batch(text["test"][0])
    assert "labels" not in x and y.shape == (100,)
    um = posthoc.wrap(text["model"], method="none")
    probs = um.predict(encoding).probs
    torch.testing.assert_close(probs, torch.softmax(text["model"](**encoding).logits, -1))
    pairs = [(dict(b.items() - {("labels", b["labels"])}), b["labels"]) for b in text["test"]]  # (x, y) pairs
    assert posthoc.evaluate(um, pairs, progress=False).nll == pytest.approx(_nll(um, text["test"]))


def test_bad_inputs_name_what_to_pass(text) -> None:
    config = text["model"].config
    x = {"input_ids": torch.tensor([[2, 5, 3], [2, 6, 3]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])}
    with pytest.raises(InputError, match="padding only.*attention_mask"):
        posthoc.wrap(text["model"], method="none").predict(x)
    with pytest.raises(InputError, match="no tensor of logits.*AutoModelForSequenceClassification"):
        posthoc.wrap(transformers.BertModel(config).eval(), method="none").predict({"input_ids": x["input_ids"]})
    tokens = transformers.BertForTokenClassification(config).eval()
    with pytest.raises(InputError, match=r"per-position logits of shape \(2, 3, 3\).*dense=True"):
        posthoc.wrap(tokens, method="none").predict({"input_ids": x["input_ids"]})
    bad = [{**text["val"][0], "labels": text["val"][0]["labels"] + 3}]
    with pytest.raises(InputError, match="num_labels"):
        posthoc.wrap(text["model"], method="temperature").fit(val_loader=bad, progress=False)
    with pytest.raises(InputError, match="padding only"):
        posthoc.wrap(text["model"], method="temperature").fit(
            val_loader=[{**x, "labels": torch.tensor([0, 1])}], progress=False
        )


# ------------------------------------------------------------------------------------------ heads and features
def test_heads_are_found_and_features_are_the_pooled_features(text, vit) -> None:
    bert, x = text["model"], text["tokenizer"](["a great plot"], return_tensors="pt")
    split = FeatureSplit(bert)
    phi, logits = split(x)
    assert split.head_name == "classifier"
    torch.testing.assert_close(phi, bert.bert(**x).pooler_output)  # BERT: the pooler output (dropout is off)
    images = next(iter(vit["test"]))[0][:3]
    split = FeatureSplit(vit["model"])
    phi, _ = split(images)
    assert split.head_name == "classifier"
    torch.testing.assert_close(phi, vit["model"].vit(images).last_hidden_state[:, 0])  # ViT: the final [CLS] state
    roberta = transformers.RobertaForSequenceClassification(
        transformers.RobertaConfig(
            vocab_size=60,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=4,
        )
    ).eval()
    assert find_head(roberta)[0] == "classifier.out_proj"  # after classifier.dense
    wrapped = hf.lora(hf.tiny_bert())
    assert (
        find_head(wrapped)[0] == "base_model.model.classifier.modules_to_save.default"
    )  # the trained copy of the head


# ------------------------------------------------------------------------------------------ methods
@pytest.mark.parametrize("case", ["text", "vit"])
def test_methods_that_apply_work_and_help_under_shift(case, request) -> None:
    setup = request.getfixturevalue(case)
    model = setup["model"]
    plain = posthoc.wrap(model, method="none")
    base = {"test": _nll(plain, setup["test"]), "shift": _nll(plain, setup["shift"])}
    for method, options in [
        ("temperature", {}),
        ("laplace", {}),
        ("laplace", {"hessian": "diag"}),
        ("mc-dropout", {"where": "head", "num_samples": 20}),
        ("swag", {"subset": "last_layer"}),
        (["laplace", "temperature"], {}),
    ]:
        um = posthoc.wrap(model, method=method, **options).fit(setup["fit"], setup["val"], progress=False)
        card = um.summary()
        assert card["posterior"][0]["layers"] in ([], ["classifier"]), card
        nll = _nll(um, setup["test"])
        assert math.isfinite(nll) and nll <= 1.1 * base["test"], (method, options, nll, base)
        if method in ("laplace", "mc-dropout"):
            assert _nll(um, setup["shift"]) < base["shift"], (method, options)


def test_mc_dropout_head_uses_the_classifiers_own_dropout(text, vit) -> None:
    um = posthoc.wrap(text["model"], method="mc-dropout", where="head")
    um.predict(text["tokenizer"](["a great plot"], return_tensors="pt"))
    card = um.method.summary()
    assert card["dropout_rate"] == [text["model"].dropout.p] == [0.1]
    assert card["rate_from"].startswith("the classifier's own dropout")
    inserted = posthoc.wrap(vit["model"], method="mc-dropout", where="head").method.summary()  # ViT has no head dropout
    assert inserted["rate_from"].startswith("default for inserted dropout")


def test_methods_that_cannot_apply_say_so(text) -> None:
    um = posthoc.wrap(text["model"], method="ibnn")
    with pytest.raises(ConfigError, match="no BatchNorm layer.*LayerNorm"):
        um.fit(text["fit"][:1], progress=False, batchnorm="train")
    with pytest.raises(InputError, match="subset='lora'"):
        posthoc.wrap(text["model"], method="laplace", subset=["classifier"]).fit(text["fit"], progress=False)
    with pytest.raises(ConfigError, match="no active LoRA adapter"):
        posthoc.wrap(text["model"], method="laplace", subset="lora")


# ------------------------------------------------------------------------------------------ LoRA Laplace
@pytest.fixture(scope="module")
def lora_model(text) -> nn.Module:
    base = hf.tiny_bert(seed=1)
    base.load_state_dict(text["model"].state_dict())
    model = hf.lora(base)
    return hf.train(model, text["fit"][:3], steps=30, lr=1e-2)


def _flat_jacobian(model: nn.Module, names: list[str], x: dict) -> torch.Tensor:
    """``(n, C, P)``: the logits' Jacobian in the covered parameters, by ``torch.func`` (the brute force)."""
    params = dict(model.named_parameters())
    covered = {name: params[name].detach() for name in names}

    def logits(values, row):
        return torch.func.functional_call(
            model, {**params, **values}, args=(), kwargs={k: v[None] for k, v in row.items()}
        ).logits[0]

    rows = [{k: v[i] for k, v in x.items()} for i in range(len(x["input_ids"]))]
    return torch.stack(
        [torch.cat([j.flatten(1) for j in torch.func.jacrev(logits)(covered, row).values()], 1) for row in rows]
    )


def test_lora_diag_curvature_and_glm_covariance_match_the_brute_force(lora_model, text) -> None:
    batch = text["val"][0]
    x = {k: v[:12].to(torch.float64) if v.is_floating_point() else v[:12] for k, v in batch.items() if k != "labels"}
    model = lora_model.double()
    try:
        names = lora_parameters(model)
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        blocks, loss = hooked_ggn(model, names, "diag", [(x, batch["labels"][:12])])
        jacobian = _flat_jacobian(model, names, x)  # (n, C, P)
        probs = torch.softmax(model(**x).logits.detach(), -1)
        hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
        ggn = torch.einsum("ncp,ncd,ndp->p", jacobian, hessian, jacobian)
        torch.testing.assert_close(torch.cat([b.diagonal.flatten() for b in blocks]), ggn)
        delta = 0.5
        gaussian = logit_gaussian(model, covered_linear_layers(model, names), blocks, x, delta)
        expected = torch.einsum("ncp,p,ndp->ncd", jacobian, 1 / (ggn + delta), jacobian)
        torch.testing.assert_close(gaussian.covariance().double(), expected)
    finally:
        model.float()


def test_lora_kron_glm_covariance_matches_the_dense_posterior(lora_model, text) -> None:
    batch = text["val"][0]
    x = {k: v[:6] for k, v in batch.items() if k != "labels"}
    model = lora_model.double()
    try:
        names = lora_parameters(model)[:2]
        blocks, _ = hooked_ggn(model, names, "kron", [(x, batch["labels"][:6])])
        precision = torch.block_diag(
            *[
                torch.kron(
                    b.out_eigvecs @ torch.diag(b.out_eigvals) @ b.out_eigvecs.T,
                    b.in_eigvecs @ torch.diag(b.in_eigvals) @ b.in_eigvecs.T,
                )
                for b in blocks
            ]
        )
        delta = 0.3
        jacobian = _flat_jacobian(model, names, x)
        expected = (
            jacobian
            @ torch.linalg.inv(precision + delta * torch.eye(len(precision), dtype=torch.float64))
            @ jacobian.transpose(1, 2)
        )
        gaussian = logit_gaussian(model, covered_linear_layers(model, names), blocks, x, delta)
        torch.testing.assert_close(gaussian.covariance().double(), expected)
    finally:
        model.float()


def test_hooked_kfac_agrees_with_backpack_on_a_plain_mlp() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).eval()
    batches = [(torch.randn(16, 5), torch.randint(0, 3, (16,))) for _ in range(3)]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    for structure in ("kron", "diag"):
        ours, our_loss = hooked_ggn(net, names, structure, batches)
        theirs, their_loss = backpack_ggn(net, names, structure, batches)
        torch.testing.assert_close(our_loss, their_loss)
        for a, b in zip(ours, theirs):
            dense = lambda block: block.diagonal if structure == "diag" else _dense(block)  # noqa: E731
            torch.testing.assert_close(dense(a), dense(b), atol=1e-9, rtol=1e-6)


def _dense(block: Curvature) -> torch.Tensor:
    out = block.out_eigvecs @ torch.diag(block.out_eigvals) @ block.out_eigvecs.T
    if block.in_eigvals is None:
        return out
    return torch.kron(out, block.in_eigvecs @ torch.diag(block.in_eigvals) @ block.in_eigvecs.T)


def test_lora_laplace_end_to_end(lora_model, text) -> None:
    plain = posthoc.wrap(lora_model, method="none")
    plain_nll = _nll(plain, text["test"][:2])
    for hessian in ("kron", "diag"):
        um = posthoc.wrap(lora_model, method="laplace", subset="lora", hessian=hessian).fit(
            text["fit"][:3], text["val"][:1], progress=False
        )
        card = um.summary()["posterior"][0]
        assert card["random_variables"] == sum(p.numel() for n, p in lora_model.named_parameters() if "lora_" in n)
        assert all("lora_" in layer for layer in card["layers"]) and card["predictive"] == "glm"
        assert _nll(um, text["test"][:2]) <= 1.02 * plain_nll
        wide = posthoc.wrap(lora_model, method="laplace", subset="lora", hessian=hessian, prior_precision=1e-2).fit(
            text["fit"][:2], progress=False
        )
        x = {k: v[:50] for k, v in text["shift"][0].items() if k != "labels"}
        assert bool(
            (wide.predict(x).entropy > plain.predict(x).entropy).float().mean() > 0.9
        )  # a wider posterior, less sure
    with pytest.raises(ConfigError, match="subset='lora' offers hessian"):
        posthoc.wrap(lora_model, method="laplace", subset="lora", hessian="full")


# ------------------------------------------------------------------------------------------ CLI and recipe
def _write_texts(path: Path, texts: list[str], labels: list[int], names: dict[int, str] | None = None) -> Path:
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["text", "label"])
            writer.writerows(zip(texts, labels))
    else:
        path.write_text(
            "".join(json.dumps({"text": t, "label": (names or {}).get(y, y)}) + "\n" for t, y in zip(texts, labels))
        )
    return path


def _evaluate(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    args = parser.parse_args([*argv, "--workers", "0", "--no-progress"])
    report = run_evaluate(args)
    assert report.is_file() and (report.parent / "summary.md").is_file()
    return json.loads((report.parent / "metrics.json").read_text())


def test_evaluate_cli_on_a_saved_text_classifier_with_its_tokenizer(text, tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    model = copy.deepcopy(text["model"])
    model.config.id2label, model.config.label2id = {0: "pos", 1: "neg", 2: "topic"}, {"pos": 0, "neg": 1, "topic": 2}
    model.save_pretrained(folder)
    text["tokenizer"].save_pretrained(folder)
    fit, val = hf.keyword_texts(300, seed=5), hf.keyword_texts(200, seed=6)
    files = {
        "train": _write_texts(tmp_path / "train.csv", *fit),
        "val": _write_texts(tmp_path / "val.jsonl", *val, names=model.config.id2label),  # labels by name
        "shift": _write_texts(tmp_path / "shift.csv", *hf.keyword_texts(100, seed=7, unknown=0.5)),
        "ood": _write_texts(tmp_path / "ood.jsonl", *hf.keyword_texts(100, seed=8, keywords=(0, 0))),
    }
    metrics = _evaluate(
        [
            "--model",
            f"hf:{folder}",
            *(f"--{k}={v}" for k, v in files.items()),
            "--batch-size",
            "50",
            "--method",
            "temperature",
            "--method",
            "laplace",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert [row["method"] for row in metrics["rows"]] == ["none", "temperature", "laplace"]
    assert metrics["classes"] == ["pos", "neg", "topic"] and metrics["sizes"]["test"] == 100
    plain = metrics["rows"][0]["test"]
    assert plain["accuracy"] > 0.85 and plain["ood_auroc"] > 0.7  # texts without keywords look unsure
    bad = _write_texts(tmp_path / "bad.csv", ["a great plot"], [7])
    with pytest.raises(InputError, match="outside the model's num_labels=3"):
        _evaluate(["--model", f"hf:{folder}", "--val", str(bad), "--out", str(tmp_path / "bad")])


def test_evaluate_cli_on_a_saved_image_classifier_with_its_processor(vit, digits, tmp_path: Path) -> None:
    folder = tmp_path / "vit"
    vit["model"].save_pretrained(folder)
    hf.digits_processor().save_pretrained(folder)
    x, y = digits.test.tensors
    pixels = ((x[:64] * data.STD + data.MEAN).clamp(0, 1) * 255).round().byte().squeeze(1).numpy()
    for index, (image, label) in enumerate(zip(pixels, y[:64].tolist())):
        (tmp_path / "val" / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(tmp_path / "val" / str(label) / f"{index}.png")
    metrics = _evaluate(
        [
            "--model",
            f"hf:{folder}",
            "--val",
            str(tmp_path / "val"),
            "--method",
            "temperature",
            "--batch-size",
            "32",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert (
        metrics["rows"][0]["test"]["accuracy"] > 0.3
    )  # chance is 1/8: the processor gives the inputs it was trained on


def test_huggingface_text_recipe_loads_with_from_pretrained_and_reports(text, lora_model, tmp_path: Path) -> None:
    recipe = runpy.run_path(str(Path(__file__).resolve().parents[2] / "recipes" / "huggingface_text.py"))
    assert "recipes/huggingface_text.py" in recipe["__doc__"] and "from_pretrained" in recipe["__doc__"]
    base_folder, adapter_folder = tmp_path / "base", tmp_path / "adapter"
    text["model"].save_pretrained(base_folder)
    text["tokenizer"].save_pretrained(base_folder)
    lora_model.peft_config["default"].base_model_name_or_path = str(base_folder)
    lora_model.save_pretrained(adapter_folder)
    text["tokenizer"].save_pretrained(adapter_folder)
    loaded, _ = recipe["load_model"](str(adapter_folder))
    x = text["tokenizer"](["a great plot"], return_tensors="pt")
    torch.testing.assert_close(loaded(**x).logits, lora_model(**x).logits)  # base + adapter, as fine-tuned
    train = _write_texts(tmp_path / "train.jsonl", *hf.keyword_texts(200, seed=9))
    val = _write_texts(tmp_path / "val.jsonl", *hf.keyword_texts(200, seed=10))
    out = tmp_path / "report"
    assert (
        recipe["main"](
            [
                "--model",
                str(adapter_folder),
                "--train",
                str(train),
                "--val",
                str(val),
                "--method",
                "laplace",
                "--option",
                "subset=lora",
                "--batch-size",
                "50",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    plain, lora_laplace = (row["test"] for row in metrics["rows"])
    assert metrics["rows"][1]["summary"]["posterior"][0]["layers"][0].endswith("lora_A.default")
    assert (
        lora_laplace["accuracy"] == pytest.approx(plain["accuracy"], abs=0.03)
        and lora_laplace["nll"] <= 1.05 * plain["nll"]
    )


# ------------------------------------------------------------------------------------------ ensembles and OOD detectors
def test_ensembles_and_ood_detectors_take_hugging_face_models(text) -> None:
    x = {k: v for k, v in text["test"][0].items() if k != "labels"}
    other = hf.train(hf.tiny_bert(seed=3), text["fit"][:3], steps=20)
    ensemble = posthoc.wrap([text["model"], other], method="none")
    with torch.no_grad():
        expected = (torch.softmax(text["model"](**x).logits, -1) + torch.softmax(other(**x).logits, -1)) / 2
    torch.testing.assert_close(ensemble.predict(x).probs, expected)
    tokenizer = text["tokenizer"]
    no_keywords = tokenizer(hf.keyword_texts(100, seed=11, keywords=(0, 0))[0], padding=True, return_tensors="pt")
    detector = posthoc.detector(text["model"], score=["energy", "mahalanobis", "knn"]).fit(text["fit"][:4])
    inside, outside = detector.scores(x), detector.scores(no_keywords)
    for name in ("energy", "mahalanobis", "knn"):
        assert inside[name].shape == (100,) and outside[name].shape == (100,)
    auroc = (outside["energy"][:, None] > inside["energy"][None, :]).float().mean()
    assert float(auroc) > 0.6  # texts without a keyword score as more OOD than the test texts


def test_without_the_extra_the_message_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees without the extra
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'posthoc\[hf\]'"):
        posthoc_apps.loading.hf.load_classifier(f"hf:{tmp_path}")
    with pytest.raises(ImportError, match=r"pip install 'posthoc\[hf\]'"):
        hf.tiny_bert()


# ------------------------------------------------------------------------------------------ a one-output regressor


def test_huggingface_regression_recipe_on_a_one_output_model(tmp_path: Path, capsys) -> None:
    """A tiny BERT with ``num_labels=1, problem_type="regression"`` trained on the keyword task's class id as a
    real target: its ``logits (N, 1)`` are the means, the head ``classifier`` is found, Laplace is fitted on it."""
    recipe = runpy.run_path(str(Path(__file__).resolve().parents[2] / "recipes" / "huggingface_regression.py"))
    assert "recipes/huggingface_regression.py" in recipe["__doc__"] and "num_labels=1" in recipe["__doc__"]
    tokenizer = hf.word_tokenizer()
    model = hf.tiny_bert(num_labels=1)
    model.config.problem_type = "regression"
    texts, labels = hf.keyword_texts(600, seed=0)
    batches = hf.text_batches(texts, [float(y) for y in labels], tokenizer, 32)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(120):  # the model's own loss: MSE under problem_type="regression"
        optimizer.zero_grad()
        model(**batches[step % len(batches)]).loss.backward()
        optimizer.step()
    model.eval()
    folder = tmp_path / "regressor"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded, _ = recipe["load_model"](str(folder))
    assert loaded.config.num_labels == 1 and loaded.config.problem_type == "regression"
    paths = {}
    for name, seed in (("train", 5), ("val", 6), ("test", 7)):
        rows = zip(*hf.keyword_texts(150, seed=seed))
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"text": t, "score": float(y)}) + "\n" for t, y in rows))
    out = tmp_path / "report"
    assert (
        recipe["main"](
            [
                "--model",
                str(folder),
                "--train",
                str(paths["train"]),
                "--val",
                str(paths["val"]),
                "--test",
                str(paths["test"]),
                "--method",
                "laplace",
                "--batch-size",
                "50",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    plain, laplace = (row["test"] for row in metrics["rows"])
    assert metrics["rows"][1]["summary"]["posterior"][0]["layers"][0] == "classifier"
    spread = float(torch.tensor(hf.keyword_texts(150, seed=7)[1], dtype=torch.float64).std())
    assert laplace["rmse"] < 0.7 * spread  # the model learned the target (0.7: far from predicting the mean)
    assert laplace["nll"] <= plain["nll"] + 0.02  # last-layer Laplace keeps the plain model's quality (nats)
    assert "| laplace |" in capsys.readouterr().out
    with pytest.raises(InputError, match="the regression target 'score' is 'high', not a number"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"text": "a plot", "score": "high"}) + "\n")
        posthoc_apps.loading.hf.TextFile(bad, loaded, target="score")
