"""The dense recipes end to end, offline: ``recipes/segmentation_torchvision.py --random`` (a torchvision LRASPP with
random weights on synthetic scenes) and ``recipes/causal_lm_lora.py`` (``--random``: the tiny byte-level GPT-2 of
``posthoc_apps.demo.tokens``; and its ``from_pretrained`` path on a tiny GPT-2 and tokenizer saved to disk here).
Their streamed token metrics are checked against ``posthoc.evaluate`` on the same model."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import posthoc
from posthoc_apps.demo import tokens

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_segmentation_recipe_runs_offline_with_random_weights(tmp_path: Path, capsys) -> None:
    recipe = _recipe("segmentation_torchvision")
    assert 'weights="DEFAULT"' in recipe.__doc__ + open(RECIPES / "segmentation_torchvision.py").read()
    out = tmp_path / "seg"
    argv = ["--random", "--train-steps", "15", "--train-subset", "32", "--val-subset", "32", "--test-subset", "16"]
    assert recipe.main([*argv, "--method", "none", "--method", "temperature", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["none", "temperature"]
    for row in metrics.values():
        assert all(math.isfinite(row[m]) for m in ("NLL", "ECE", "Brier", "accuracy"))
        risk = row["risk_control"]
        assert risk["alpha"] == 0.1 and 0.0 <= risk["test_fnr"] <= 1.0 and risk["calibration_bound"] <= 0.1
    # temperature only rescales the logits: the argmax, so the accuracy, is the plain model's
    assert metrics["temperature"]["accuracy"] == metrics["none"]["accuracy"]
    report = (out / "report.md").read_text()
    assert "| none |" in report and "| temperature |" in report and "test FNR" in report
    assert "risk control at alpha=0.1: test FNR" in capsys.readouterr().out


def test_segmentation_recipe_without_data_names_both_ways(tmp_path: Path, capsys) -> None:
    recipe = _recipe("segmentation_torchvision")
    assert recipe.main(["--out", str(tmp_path)]) != 0
    assert "--voc ROOT" in capsys.readouterr().err


def test_causal_lm_recipe_offline_and_its_streamed_metrics_match_posthoc_evaluate(tmp_path: Path) -> None:
    recipe = _recipe("causal_lm_lora")
    out = tmp_path / "lm"
    argv = ["--random", "--base-steps", "60", "--lora-steps", "30", "--out", str(out)]
    assert recipe.main([*argv, "--method", "none", "--method", "auto"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["none", "auto"] and metrics["auto"]["chosen"] in ("none", "temperature")
    for row in metrics.values():
        for part in ("test", "shift"):
            assert all(math.isfinite(row[part][m]) for m in ("NLL", "ECE", "accuracy")) and row[part]["tokens"] > 1000
    assert "| auto (chose " in (out / "report.md").read_text()
    # the recipe's streamed NLL / ECE / accuracy are posthoc.evaluate's on the same windows (float64 sums against
    # posthoc's own reductions: agreement to 1e-6)
    task = tokens.token_task(0, steps=60, lora_steps=30)
    um = posthoc.wrap(task["lora"], method="none", dense=True).fit(None, task["tune_val"], progress=False)
    reference = posthoc.evaluate(um, task["tune_test"], name="none").rows["none"]
    for name in ("NLL", "ECE", "accuracy"):
        assert math.isclose(metrics["none"]["test"][name], reference[name], rel_tol=1e-6, abs_tol=1e-6), name


def test_causal_lm_recipe_loads_with_from_pretrained(tmp_path: Path) -> None:
    """The real path (``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer``, peft LoRA tuning) on a tiny GPT-2
    and a byte-level BPE tokenizer trained and saved here (no download)."""
    import tokenizers
    import transformers

    text = tokens.shipped_text("train")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=300, min_frequency=2, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    folder = tmp_path / "tiny-gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "train.txt").write_text(text[:6000])
    (tmp_path / "shift.txt").write_text(tokens.shipped_text("shift")[:3000])
    out = tmp_path / "lm"
    argv = ["--model", str(folder), "--train", str(tmp_path / "train.txt"), "--shift", str(tmp_path / "shift.txt")]
    argv += ["--context", "32", "--lora-steps", "5", "--method", "temperature", "--out", str(out)]
    assert _recipe("causal_lm_lora").main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert math.isfinite(metrics["temperature"]["test"]["NLL"]) and metrics["temperature"]["shift"]["tokens"] > 100
