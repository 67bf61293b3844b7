"""Retrofit calibrated token probabilities onto a Hugging Face causal language model tuned with LoRA.

Run it on a machine with internet (or a filled Hugging Face cache) and two text files of your own::

    python recipes/causal_lm_lora.py --model gpt2 --train my_domain.txt --shift other_domain.txt \\
        --lora-steps 300 --context 128 --method none --method temperature --method auto --out reports/gpt2-lora

Offline, ``--random`` runs the same steps on the tiny byte-level GPT-2 of ``posthoc_apps.demo.tokens`` (random
init, trained here on scipy's license text, LoRA-tuned on PyTorch's README, shifted to ``torch.nn.functional``'s
docstrings); the test suite runs it so.

Steps: (1) ``AutoModelForCausalLM.from_pretrained(--model)`` and its tokenizer; (2) the ``--train`` text tokenized
and cut into windows of ``--context`` tokens, split 70 / 15 / 15 into LoRA-tuning, validation and test windows, as
``(input_ids, labels)`` batches whose ``labels[:, t]`` is the token AFTER ``input_ids[:, t]`` (the target of the
logits at ``t``; -100 where none follows), so posthoc compares them with ``model(input_ids).logits`` ``(N, T, V)``
position by position; (3) ``peft`` LoRA adapters (``--rank``) tuned for ``--lora-steps`` AdamW steps on the tuning
windows (or ``--adapter DIR``: an adapter you tuned, ``PeftModel.from_pretrained``); (4)
``posthoc.wrap(model, method=..., dense=True).fit(tune, val)`` for each ``--method``: every labelled token is an
example (``temperature``: one temperature over the vocabulary; ``auto``: ``none`` or ``temperature`` chosen on the
validation windows with the never-worse bound taken per window); (5) token NLL, accuracy and ECE (15 bins) on the
test windows (in distribution) and on the ``--shift`` text, streamed batch by batch so that a 50,257-token
vocabulary never holds more than one batch of probabilities; ``report.md`` and ``metrics.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import posthoc
from posthoc.errors import exit_status
from posthoc.evaluation.metrics import binned_gap
from posthoc_apps.demo import tokens

#: the label of a position with no next token (Hugging Face's)
IGNORE_INDEX = -100
#: the bins of the ECE (equal width on [0, 1], as posthoc.evaluate's)
ECE_BINS = 15


def windows(ids: Tensor, context: int, batch_size: int) -> list[tuple[Tensor, Tensor]]:
    """``(input_ids, labels)`` batches of ``context``-token windows of the stream ``ids``, labels aligned to the logits
    (:func:`posthoc_apps.demo.tokens.token_batches`)."""
    return tokens.token_batches(ids, context=context, batch_size=batch_size)


def split(batches: list[tuple[Tensor, Tensor]], fractions: tuple[float, float] = (0.7, 0.15)) -> tuple[list, ...]:
    """Windows cut into tuning, validation and test parts (contiguous: held-out text is text not tuned on)."""
    inputs, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    first, second = int(len(inputs) * fractions[0]), int(len(inputs) * sum(fractions))
    size = len(batches[0][0])
    return tuple(
        [(inputs[k : k + size], labels[k : k + size]) for k in range(lo, hi, size)]
        for lo, hi in ((0, first), (first, second), (second, len(inputs)))
    )


def real_task(args: argparse.Namespace) -> dict[str, Any]:
    """The pretrained model (``from_pretrained``), LoRA-tuned on ``--train`` (or ``--adapter``), and its windows."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.train is None or args.shift is None:
        raise posthoc.InputError(
            "pass --train TEXT and --shift TEXT (plain text files), or --random (offline, the tiny model)"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)

    def ids(path: Path) -> Tensor:
        return tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]

    tune, val, test = split(windows(ids(args.train), args.context, args.batch_size))
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter)
    else:
        config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05)
        model = tokens.train_lm(get_peft_model(model, config), tune, steps=args.lora_steps, lr=args.lr)
    shift = windows(ids(args.shift), args.context, args.batch_size)[: max(1, len(test))]
    return {"model": model.eval(), "tune": tune, "val": val, "test": test, "shift": shift}


def random_task(args: argparse.Namespace) -> dict[str, Any]:
    """The tiny byte-level GPT-2 of :mod:`posthoc_apps.demo.tokens`, LoRA-tuned on the second shipped text."""
    task = tokens.token_task(args.seed, steps=args.base_steps, lora_steps=args.lora_steps)
    return {
        "model": task["lora"],
        "tune": task["tune_train"],
        "val": task["tune_val"],
        "test": task["tune_test"],
        "shift": task["shift"],
    }


@torch.no_grad()
def token_metrics(um: Any, batches: Iterable[tuple[Tensor, Tensor]]) -> dict[str, float]:
    """Token NLL (nats), accuracy and ECE over the labelled positions, one batch of probabilities at a time."""
    nll, confidence, correct = [], [], []
    for input_ids, labels in batches:
        probs = um.predict(input_ids).probs  # (N, T, V)
        valid = labels != IGNORE_INDEX
        kept, target = probs[valid].double(), labels[valid]
        nll.append(-kept.gather(1, target[:, None])[:, 0].clamp_min(1e-300).log())
        top, predicted = kept.max(1)
        confidence.append(top)
        correct.append((predicted == target).double())
    confidence, correct = torch.cat(confidence), torch.cat(correct)
    edges = torch.linspace(0, 1, ECE_BINS + 1, dtype=torch.float64)
    return {
        "NLL": float(torch.cat(nll).mean()),
        "accuracy": float(correct.mean()),
        "ECE": float(binned_gap(confidence, correct, edges)),
        "tokens": len(correct),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="a Hugging Face causal LM (Hub id or save_pretrained folder)")
    p.add_argument("--train", type=Path, help="text file: LoRA tuning, validation and test (70/15/15)")
    p.add_argument("--shift", type=Path, help="text file of another kind: the shifted test")
    p.add_argument("--adapter", help="a tuned LoRA adapter folder (PeftModel.from_pretrained) instead of tuning one")
    p.add_argument("--random", action="store_true", help="the tiny byte-level GPT-2 and shipped texts: runs offline")
    p.add_argument("--context", type=int, default=128, help="tokens per window")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-steps", type=int, default=200, help="AdamW steps of LoRA tuning")
    p.add_argument("--lr", type=float, default=3e-4, help="LoRA learning rate (the real model's)")
    p.add_argument("--base-steps", type=int, default=200, help="--random: steps training the tiny base model")
    p.add_argument("--method", action="append", help="posthoc method (repeatable); default: none, temperature, auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("reports/causal-lm-lora"))
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole recipe; returns what it writes to ``metrics.json``."""
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    task = random_task(args) if args.random else real_task(args)
    metrics: dict[str, Any] = {}
    for method in args.method or ["none", "temperature", "auto"]:
        um = posthoc.wrap(task["model"], method=method, dense=True).fit(task["tune"], task["val"], progress=False)
        metrics[method] = {name: token_metrics(um, task[name]) for name in ("test", "shift")}
        if method == "auto":
            metrics[method]["chosen"] = um.summary()["posterior"][0]["selection"]["chosen"]
        row = metrics[method]
        print(
            f"{method}: token NLL {row['test']['NLL']:.4f} (shift {row['shift']['NLL']:.4f}), "
            f"ECE {row['test']['ECE']:.4f} (shift {row['shift']['ECE']:.4f})"
        )
    lines = [
        f"# {'tiny byte-level GPT-2 (--random)' if args.random else args.model} with LoRA: token metrics",
        "",
        f"{metrics[next(iter(metrics))]['test']['tokens']:,} test tokens in distribution, "
        f"{metrics[next(iter(metrics))]['shift']['tokens']:,} on the shifted text.",
        "",
        "| method | NLL | ECE | accuracy | NLL (shift) | ECE (shift) | accuracy (shift) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in metrics.items():
        cells = [f"{row[part][m]:.4f}" for part in ("test", "shift") for m in ("NLL", "ECE", "accuracy")]
        label = f"{method} (chose {row['chosen']})" if "chosen" in row else method
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"wrote {args.out / 'report.md'} and {args.out / 'metrics.json'}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
