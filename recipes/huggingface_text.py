"""Retrofit uncertainty onto a Hugging Face text classifier (or its LoRA adapter), and report on text files.

Run it on a machine with internet (or a filled Hugging Face cache). Data are CSV or JSON-lines files
with a ``text`` and a ``label`` column (labels as class ids or as the model's label names)::

    python recipes/huggingface_text.py --model distilbert-base-uncased-finetuned-sst-2-english \\
        --train sst2_train.jsonl --train-subset 5000 --val sst2_validation.jsonl --ood imdb_sample.jsonl \\
        --method temperature --method laplace --method mc-dropout --out reports/sst2

    # your LoRA fine-tune (a folder written by peft's save_pretrained): Laplace over the adapters only
    python recipes/huggingface_text.py --model my-lora-adapter/ --train train.jsonl --val val.jsonl \\
        --method laplace --option subset=lora --out reports/lora

Steps: (1) ``AutoModelForSequenceClassification.from_pretrained`` and ``AutoTokenizer.from_pretrained``
(a folder with ``adapter_config.json`` loads its base model, then ``PeftModel.from_pretrained``);
(2) the text files, batched with the model's own tokenizer into ``(BatchEncoding, labels)`` pairs;
(3) ``posthoc.wrap(model, method).fit(train, calibration half of val)`` for each ``--method`` row,
next to the plain model: the head (``classifier``, ``classifier.out_proj``, ``score``) is found
automatically and last-layer methods see the pooled features; (4) ``posthoc.evaluate`` on the test
half of val, the OOD and the shift files; (5) ``report.md``, ``summary.md``, ``metrics.json`` and
the PNGs in ``--out``.

The same run as a command: ``posthoc evaluate --model hf:distilbert-base-uncased-finetuned-sst-2-english
--val val.jsonl ...`` (image classifiers: ``hf:google/vit-base-patch16-224`` on image folders).
``--pretrained false`` builds the architecture with random weights. See ``--help`` for every option.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from posthoc.errors import exit_status
from posthoc_apps.cli.evaluate import add_model_options, add_run_arguments, load_texts, run_retrofit
from posthoc_apps.loading.hf import ADAPTER_CONFIG, require_peft, require_transformers


def load_model(name: str, pretrained: bool = True, num_classes: int | None = None) -> tuple[nn.Module, Any]:
    """The classifier and its tokenizer, by ``from_pretrained`` (a LoRA adapter folder: base model + adapter)."""
    transformers = require_transformers()  # ImportError naming pip install 'posthoc[hf]' when missing
    adapter = Path(name, ADAPTER_CONFIG)
    if adapter.is_file():
        peft = require_peft()
        base, tokenizer = load_model(
            json.loads(adapter.read_text())["base_model_name_or_path"], pretrained, num_classes
        )
        return peft.PeftModel.from_pretrained(base, name).eval(), tokenizer
    labels = {} if num_classes is None else {"num_labels": num_classes, "ignore_mismatched_sizes": True}
    if pretrained:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(name, **labels)
    else:
        config = transformers.AutoConfig.from_pretrained(
            name, **({} if num_classes is None else {"num_labels": num_classes})
        )
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    return model.eval(), tokenizer


def parser() -> argparse.ArgumentParser:
    """``--model`` (a Hub id or a local folder) and the shared data, method and run options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="distilbert-base-uncased-finetuned-sst-2-english",
        metavar="NAME",
        help="a Hugging Face Hub id or a save_pretrained folder (a peft adapter folder too)",
    )
    add_model_options(parser)
    add_run_arguments(parser)
    parser.epilog = (
        "--train/--val/--calibration/--shift/--ood take .csv or .jsonl files with 'text' and 'label' columns"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> None:
        model, tokenizer = load_model(args.model, args.pretrained, args.num_classes)
        run_retrofit(model, tokenizer, args, title=f"Hugging Face {args.model}", load_data=load_texts)

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
