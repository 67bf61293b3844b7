"""Hugging Face classifiers and their preprocessing: ``posthoc evaluate --model hf:<repo-or-path>``.

``load_classifier`` reads the model's config and builds an ``AutoModelForImageClassification``
(with its ``AutoImageProcessor``) or an ``AutoModelForSequenceClassification`` (with its
``AutoTokenizer``) by ``from_pretrained``; a folder with an ``adapter_config.json`` is a ``peft``
adapter loaded onto its base model. Image folders go through :func:`image_transform`; text comes
from a CSV or JSON-lines file with ``text`` and ``label`` columns (:class:`TextFile`, labels as ids
or as the names in the model's ``label2id``), batched by :func:`text_loader` into ``(BatchEncoding,
labels)`` pairs padded per batch.

``transformers`` and ``peft`` are the optional extra ``posthoc[hf]``; nothing else in posthoc
imports them, and without them these functions say how to install them.

Example:
    >>> model, tokenizer = load_classifier("distilbert-base-uncased-finetuned-sst-2-english")  # doctest: +SKIP
    >>> texts = TextFile("reviews.jsonl", model)  # doctest: +SKIP
    >>> x, y = next(iter(text_loader(texts, tokenizer, batch_size=8)))  # doctest: +SKIP
    >>> sorted(x), y.shape  # doctest: +SKIP
    (['attention_mask', 'input_ids'], torch.Size([8]))
"""

from __future__ import annotations

import csv
import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from posthoc.errors import ConfigError, InputError
from posthoc_apps.loading.folders import take_subset

#: the ``--model`` prefix of a Hugging Face model
PREFIX = "hf:"
MISSING = "Hugging Face models need the optional extra: pip install 'posthoc[hf]' (transformers and peft)"
TEXT_COLUMN, LABEL_COLUMN = "text", "label"
ADAPTER_CONFIG = "adapter_config.json"


def _optional(module: str) -> Any:
    """Import the optional ``module`` on first use (the CLI and ``import posthoc`` stay fast without it)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(MISSING) from err


def require_transformers() -> Any:
    """The ``transformers`` module, or an ``ImportError`` naming ``pip install 'posthoc[hf]'``."""
    return _optional("transformers")


def require_peft() -> Any:
    """The ``peft`` module, or an ``ImportError`` naming ``pip install 'posthoc[hf]'``."""
    return _optional("peft")


def is_image_classifier(config: Any) -> bool:
    """Whether a ``transformers`` config describes an image classifier (by its architectures or its image size)."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any("ImageClassification" in name for name in architectures)
    return hasattr(config, "image_size") or hasattr(config, "num_channels")


def load_classifier(name: str, *, pretrained: bool = True, num_classes: int | None = None) -> tuple[nn.Module, Any]:
    """``(model in eval mode, processor)`` for a Hub id or local folder: an image processor or a tokenizer.

    ``pretrained=False`` builds the architecture with random weights from the config;
    ``num_classes`` resizes the head (``num_labels``). A ``peft`` adapter folder loads its base model
    and the adapter on top.

    Example:
        >>> model, processor = load_classifier("google/vit-base-patch16-224")  # doctest: +SKIP
    """
    hf = require_transformers()
    path = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    adapter = Path(path, ADAPTER_CONFIG)
    if adapter.is_file():
        peft = require_peft()
        base = json.loads(adapter.read_text())["base_model_name_or_path"]
        model, processor = load_classifier(base, pretrained=pretrained, num_classes=num_classes)
        return peft.PeftModel.from_pretrained(model, path).eval(), processor
    options = {} if num_classes is None else {"num_labels": num_classes, "ignore_mismatched_sizes": True}
    try:
        config = hf.AutoConfig.from_pretrained(path, **({} if num_classes is None else {"num_labels": num_classes}))
        image = is_image_classifier(config)
        auto = hf.AutoModelForImageClassification if image else hf.AutoModelForSequenceClassification
        model = auto.from_pretrained(path, **options) if pretrained else auto.from_config(config)
        processor = (hf.AutoImageProcessor if image else hf.AutoTokenizer).from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"could not load the Hugging Face classifier {path!r} ({err}); pass a Hub id (needs internet or a filled "
            "cache) or a folder written by save_pretrained holding the model and its tokenizer / image processor"
        ) from err
    return model.eval(), processor


def is_tokenizer(processor: Any) -> bool:
    """Whether ``processor`` is a tokenizer (text) rather than an image processor."""
    return hasattr(processor, "convert_tokens_to_ids")


class ProcessorTransform:
    """A PIL image -> ``pixel_values`` ``(C, H, W)`` transform from the model's own image processor; its
    ``image_mean`` / ``image_std`` tell the normalisation (what image corruptions undo and redo).

    Example:
        >>> ProcessorTransform(processor)(Image.new("RGB", (32, 32))).shape  # doctest: +SKIP
        torch.Size([3, 224, 224])
    """

    def __init__(self, processor: Any, image_size: int | None = None) -> None:
        self.processor = processor
        self.options = {} if image_size is None else {"size": {"height": image_size, "width": image_size}}
        self.image_mean = getattr(processor, "image_mean", None)
        self.image_std = getattr(processor, "image_std", None)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.processor(images=image.convert("RGB"), return_tensors="pt", **self.options)["pixel_values"][0]


def image_transform(processor: Any, image_size: int | None = None) -> ProcessorTransform:
    """The image transform of ``processor`` (an ``AutoImageProcessor``), optionally at ``image_size``."""
    return ProcessorTransform(processor, image_size)


class TextFile(Dataset):
    """``(text, label id)`` rows of a CSV (header row) or JSON-lines file with ``text`` and ``label`` columns.

    Labels are class ids, or names in the model's ``config.label2id``; ``labelled=False`` (an OOD
    file) ignores them (label ``-1``). ``.classes`` holds the model's class names in id order.
    ``target="score"`` reads a regressor's rows instead (``num_labels=1``, ``problem_type="regression"``):
    ``(text, float)`` from the ``score`` column, batched by :func:`text_loader` as float targets.

    Example:
        >>> TextFile("val.csv", model)[0]  # a Hugging Face checkpoint  # doctest: +SKIP
        ('a fine film', 1)
    """

    def __init__(
        self, path: str | os.PathLike, model: nn.Module, *, labelled: bool = True, target: str | None = None
    ) -> None:
        self.root = Path(path)
        if not self.root.is_file():
            raise InputError(
                f"{self.root} is not a file; text data is a .csv or .jsonl file with 'text' and 'label' columns"
            )
        config = getattr(model, "config", None)
        labels = int(getattr(config, "num_labels", 0) or 0)
        id2label = getattr(config, "id2label", None) or {}
        self.classes = [str(id2label.get(i, i)) for i in range(labels)]
        names = {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
        rows = _read_rows(self.root)
        self.texts, self.labels = [], []
        for number, row in enumerate(rows, 1):
            if TEXT_COLUMN not in row:
                raise InputError(f"{self.root} row {number} has no '{TEXT_COLUMN}' column (columns: {sorted(row)})")
            self.texts.append(str(row[TEXT_COLUMN]))
            where = f"{self.root} row {number}"
            if target is not None:
                self.labels.append(_target_value(row.get(target), target, where))
            else:
                self.labels.append(_label_id(row.get(LABEL_COLUMN), names, labels, where) if labelled else -1)
        if not self.texts:
            raise InputError(f"{self.root} holds no rows")

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> tuple[str, int | float]:
        return self.texts[index], self.labels[index]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".jsonl", ".json"):
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise InputError(f"{path} is not JSON lines (one object per line): {err}") from err
    if path.suffix.lower() in (".csv", ".tsv"):
        return list(csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    raise InputError(f"{path}: text data must be a .csv, .tsv or .jsonl file")


def _target_value(value: Any, column: str, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(
            f"{where}: the regression target {column!r} is {value!r}, not a number; every row needs "
            f"one (columns other than 'text' and '{column}' are ignored)"
        ) from None


def _label_id(value: Any, names: dict[str, int], num_labels: int, where: str) -> int:
    if value is None or value == "":
        raise InputError(f"{where} has no '{LABEL_COLUMN}'; labelled text files need one per row")
    if str(value) in names:
        return names[str(value)]
    try:
        label = int(value)
    except (TypeError, ValueError):
        raise InputError(
            f"{where}: label {value!r} is neither a class id nor one of the model's labels {sorted(names)}"
        ) from None
    if not 0 <= label < num_labels:
        raise InputError(
            f"{where}: label id {label} is outside the model's num_labels={num_labels}; pass ids in [0, {num_labels})"
        )
    return label


def text_loader(
    dataset: Dataset,
    tokenizer: Any,
    *,
    batch_size: int = 32,
    shuffle: bool = False,
    seed: int = 0,
    max_length: int | None = None,
    subset: int | None = None,
) -> DataLoader:
    """Batches of ``(BatchEncoding, labels)`` from ``(text, label)`` rows, padded to the longest text of each batch
    (float labels, a regressor's targets, stay float).

    Example:
        >>> x, y = next(iter(text_loader(TextFile("val.jsonl", model), tokenizer, batch_size=4)))  # doctest: +SKIP
    """
    dataset = take_subset(dataset, subset, seed=seed)
    limit = max_length or min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512)

    def collate(rows: Sequence[tuple[str, int]]) -> tuple[Any, torch.Tensor]:
        texts, labels = zip(*rows)
        encoded = tokenizer(list(texts), padding=True, truncation=True, max_length=limit, return_tensors="pt")
        real = any(isinstance(label, float) for label in labels)  # a regressor's targets (TextFile target=)
        return encoded, torch.tensor(labels, dtype=torch.float32 if real else torch.long)

    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, collate_fn=collate)
