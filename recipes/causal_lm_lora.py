"""Calibrate a LoRA-tuned Hugging Face causal language model per token, in distribution and on a shifted text.

With internet (or a filled Hugging Face cache) and three text files of your own::

    python recipes/causal_lm_lora.py --model gpt2 --tune my_domain.txt --test my_domain_test.txt \\
        --shift other_domain.txt --lora-steps 200 --out reports/gpt2-lora

Offline, ``--random`` uses the tiny byte-level GPT-2 of ``posthoc_apps.demo.tokens`` (random init, trained here on
the license text scipy ships, LoRA-tuned on PyTorch's README, shifted to torch.nn.functional's docstrings); the test
suite runs it so.

Steps: (1) ``AutoModelForCausalLM.from_pretrained(NAME)`` and its tokenizer; (2) LoRA adapters on its attention
(``peft.get_peft_model``), tuned for ``--lora-steps`` AdamW steps on ``--tune``; (3) the texts cut into windows of
``(input_ids, labels)`` whose labels are ALREADY aligned to the logits (``labels[:, t]`` is the token after
``input_ids[:, t]``, -100 where none follows), so posthoc compares ``model(input_ids).logits`` ``(N, T, V)`` with
them position by position; (4) ``posthoc.wrap(model, method, dense=True)`` for each ``--method`` (default none,
temperature, auto), fitted on the tuning text (``auto`` reads the training windows too) and chosen on its held-out windows (each sequence one unit of the selection step's
bound); (5) per-token NLL, ECE, Brier and accuracy in distribution and on ``--shift``, in ``report.md`` and
``metrics.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import posthoc
from posthoc.errors import exit_status
from posthoc.evaluation.dense import evaluate_dense
from posthoc_apps.demo import tokens


def pretrained(args: argparse.Namespace) -> dict[str, Any]:
    """The model named by ``--model`` with LoRA tuned on ``--tune``, and the token loaders of the three texts."""
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    encode = lambda path: torch.tensor(tokenizer(Path(path).read_text())["input_ids"])  # noqa: E731
    tune_ids = encode(args.tune)
    fit_ids, val_ids = tokens.split_ids(tune_ids, 0.3)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM")
    tuned = tokens.train_lm(
        peft.get_peft_model(model, config),
        tokens.token_batches(fit_ids, context=args.context, batch_size=8, shuffle=True),
        steps=args.lora_steps,
    )
    batches = lambda ids: tokens.token_batches(ids, context=args.context, batch_size=8)  # noqa: E731
    return {
        "lora": tuned.eval(),
        "tune_train": batches(fit_ids),
        "tune_val": batches(val_ids),
        "tune_test": batches(encode(args.test)),
        "shift": batches(encode(args.shift)),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="a Hugging Face causal LM id or folder")
    p.add_argument("--random", action="store_true", help="the tiny byte-level GPT-2 on shipped texts: runs offline")
    p.add_argument("--tune", help="text file: LoRA tuning (70 %%) and the methods' held-out windows (30 %%)")
    p.add_argument("--test", help="text file of the same kind: in-distribution test")
    p.add_argument("--shift", help="text file of another kind: the shifted test")
    p.add_argument("--lora-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=200, help="--random: the tiny model's training steps")
    p.add_argument("--context", type=int, default=128, help="tokens per window (pretrained models)")
    p.add_argument("--method", action="append", help="posthoc method (repeatable); default: none, temperature, auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("reports/causal-lm"))
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole recipe; returns what it writes to ``metrics.json``."""
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.random:
        task = tokens.token_task(args.seed, steps=args.steps, lora_steps=args.lora_steps)
    elif not (args.tune and args.test and args.shift):
        raise posthoc.InputError("pass --tune, --test and --shift text files, or --random (offline, shipped texts)")
    else:
        task = pretrained(args)
    models = {
        method: posthoc.wrap(task["lora"], method=method, dense=True).fit(
            task["tune_train"], task["tune_val"], progress=False
        )
        for method in args.method or ["none", "temperature", "auto"]
    }
    found = {
        "in distribution": evaluate_dense(models, task["tune_test"]),
        "shift": evaluate_dense(models, task["shift"]),
    }
    markdown = "\n\n".join(
        f"## {name} ({report.positions} tokens)\n\n{report.to_markdown()}" for name, report in found.items()
    )
    (args.out / "report.md").write_text(markdown + "\n")
    metrics = {name: report.rows for name, report in found.items()}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(markdown)
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
