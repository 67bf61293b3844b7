"""Hugging Face classifiers: every method that applies on a tiny BERT and a tiny ViT, quality and predict cost.

Models (:mod:`posthoc_apps.demo.hf`, random init, trained here): a 2-layer BERT (hidden 32) on the
synthetic keyword task (1,200 fit / 400 calibration / 1,000 test texts; shift: half the keywords
replaced by words the tokenizer does not know) and a 2-layer ViT (hidden 32, 7x7 patches) on the
bundled digits (2,400 fit / 600 calibration / 1,000 test; shift: rotated 45 and 90 degrees). For
BERT, also LoRA (rank 4 on query/value, head trained beside it) fine-tuned on top of the trained
BERT, with ``laplace`` over the adapters (``subset="lora"``) next to last-layer Laplace.

Each method is fitted as in the quality protocol (``fit(train, calibration)``); the tables give
test NLL / ECE as ratios to the plain model, and the median predict time on one batch of 256 as a
ratio to one plain forward pass of the same batch (CPU time beside wall time, see ``timing.py``).
Run: ``python benchmarks/bench_huggingface.py`` (``--quick``: fewer examples and repeats).
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch
from timing import HEADER, measure, row

import posthoc
from posthoc_apps.demo import data, hf

METHODS: list[tuple[str, Any, dict[str, Any]]] = [
    ("temperature", "temperature", {}),
    ("laplace (last layer, kron)", "laplace", {}),
    ("laplace+temperature", ["laplace", "temperature"], {}),
    ("mc-dropout (own)", "mc-dropout", {}),
    ("mc-dropout (head)", "mc-dropout", {"where": "head"}),
    ("swag (last layer)", "swag", {"subset": "last_layer"}),
]


def _text_setup(quick: bool) -> dict[str, Any]:
    tokenizer = hf.word_tokenizer()
    sizes = (600, 300, 500) if quick else (1200, 400, 1000)
    pairs = {
        "fit": hf.keyword_texts(sizes[0], seed=0),
        "calibration": hf.keyword_texts(sizes[1], seed=1),
        "test": hf.keyword_texts(sizes[2], seed=2),
        "shift (unknown keywords)": hf.keyword_texts(sizes[2], seed=3, unknown=0.5),
    }
    batches = {name: hf.text_batches(*pair, tokenizer, 128) for name, pair in pairs.items()}
    model = hf.train(hf.tiny_bert(), hf.text_batches(*pairs["fit"], tokenizer, 32), steps=150 if quick else 300)
    x = {k: v for k, v in hf.text_batches(*hf.keyword_texts(256, seed=4), tokenizer, 256)[0].items() if k != "labels"}
    return {"model": model, "batches": batches, "x": x}


def _vit_setup(quick: bool) -> dict[str, Any]:
    splits = data.load_digits()
    fit = hf.rgb(data.subset(splits.fit, 1200) if quick else splits.fit)
    test = data.subset(splits.test, 500) if quick else splits.test
    model = hf.train(hf.tiny_vit(), data.loader(fit, 32, shuffle=True, seed=0), steps=150 if quick else 400)
    batches = {
        "fit": data.loader(fit, 256),
        "calibration": data.loader(hf.rgb(splits.calibration), 256),
        "test": data.loader(hf.rgb(test), 256),
        "rotated 45": data.loader(hf.rgb(data.rotated(test, 45)), 256),
        "rotated 90": data.loader(hf.rgb(data.rotated(test, 90)), 256),
    }
    return {"model": model, "batches": batches, "x": hf.rgb(data.subset(splits.test, 256)).tensors[0]}


def _lora_setup(text: dict[str, Any], quick: bool) -> dict[str, Any]:
    base = hf.tiny_bert(seed=1)
    base.load_state_dict(text["model"].state_dict())
    model = hf.train(hf.lora(base), text["batches"]["fit"], steps=20 if quick else 40, lr=1e-2)
    return {**text, "model": model}


def evaluate_methods(
    name: str, setup: dict[str, Any], methods: list[tuple[str, Any, dict[str, Any]]], repeats: int
) -> None:
    """Print quality ratios and predict-cost ratios for ``methods`` on one model."""
    model, batches, x = setup["model"], setup["batches"], setup["x"]
    held_out = [key for key in batches if key not in ("fit", "calibration")]
    plain_um = posthoc.wrap(model, method="none")
    plain = {key: posthoc.evaluate(plain_um, batches[key], progress=False) for key in held_out}
    forward = measure(lambda: _forward(model, x), repeats=repeats)
    print(f"\n## {name}\n")
    print("| method | fit s | " + " | ".join(f"NLL {k}" for k in held_out) + " | ECE test |")
    print("|---|---|" + "---|" * len(held_out) + "---|")
    print("| plain | – | " + " | ".join(f"{plain[k].nll:.4f}" for k in held_out) + f" | {plain['test'].ece:.4f} |")
    timings: list[tuple[str, Any]] = []
    for label, method, options in methods:
        start = time.perf_counter()
        um = posthoc.wrap(model, method=method, **options).fit(batches["fit"], batches["calibration"], progress=False)
        fit_seconds = time.perf_counter() - start
        reports = {key: posthoc.evaluate(um, batches[key], progress=False) for key in held_out}
        cells = " | ".join(f"{reports[k].nll:.4f} ({reports[k].nll / plain[k].nll:.2f}x)" for k in held_out)
        print(
            f"| {label} | {fit_seconds:.1f} | {cells} | {reports['test'].ece:.4f} ({reports['test'].ece / plain['test'].ece:.2f}x) |"
        )
        timings.append((label, measure(lambda um=um: um.predict(x), repeats=repeats)))
    print(
        f"\npredict on {len(x) if isinstance(x, torch.Tensor) else len(x['input_ids'])} examples against one plain forward\n"
    )
    print(HEADER)
    print(row("plain forward", forward, forward))
    for label, timing in timings:
        print(row(label, timing, forward))


def _forward(model: torch.nn.Module, x: Any) -> Any:
    with torch.no_grad():
        return model(**x) if isinstance(x, dict) else model(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer examples, training steps and repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    repeats = 3 if args.quick else 7
    text = _text_setup(args.quick)
    evaluate_methods("BERT (2 layers, hidden 32) on the keyword task", text, METHODS, repeats)
    evaluate_methods("ViT (2 layers, hidden 32) on the bundled digits", _vit_setup(args.quick), METHODS, repeats)
    lora = [
        ("laplace (last layer, kron)", "laplace", {}),
        ("laplace (LoRA adapters, kron)", "laplace", {"subset": "lora"}),
        ("laplace (LoRA adapters, diag)", "laplace", {"subset": "lora", "hessian": "diag"}),
    ]
    evaluate_methods("BERT + LoRA (rank 4, query/value)", _lora_setup(text, args.quick), lora, repeats)


if __name__ == "__main__":
    main()
