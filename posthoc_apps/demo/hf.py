"""Tiny Hugging Face classifiers trained here, for the tests, the recipe's check and the benchmark.

No weights can be downloaded on the machines this project is tested on, so these are randomly
initialised ``transformers`` models of the real architectures (BERT, ViT) at toy size, trained for a
few hundred steps on data that ships with posthoc or is made here:

- :func:`tiny_vit` on the bundled digits (28x28, grey repeated to RGB by :func:`rgb`, 7x7 patches;
  :func:`digits_processor` is the matching ``ViTImageProcessor``);
- :func:`tiny_bert` on :func:`keyword_texts`, a synthetic 3-class text task (each text holds a few
  class keywords among filler words, some keywords of another class, and 5% flipped labels), with a
  word-level tokenizer built by :func:`word_tokenizer` (a ``PreTrainedTokenizerFast``);
- :func:`lora` adds LoRA adapters (``peft``) to a model and fine-tunes only them and the head.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.hf import keyword_texts, text_batches, tiny_bert, train, word_tokenizer
    >>> tokenizer = word_tokenizer()
    >>> texts, labels = keyword_texts(200, seed=0)
    >>> model = train(tiny_bert(), text_batches(texts, labels, tokenizer, 32), steps=10)
    >>> posthoc.wrap(model, method="laplace").fit(text_batches(texts, labels, tokenizer, 64)).predict(
    ...     tokenizer(texts[:2], padding=True, return_tensors="pt")).probs.shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from posthoc.core.inputs import run_model, split_batch
from posthoc_apps.demo.data import MEAN, STD
from posthoc_apps.loading.hf import require_peft, require_transformers

try:
    import tokenizers
except ImportError:  # comes with transformers (the optional extra posthoc[hf])
    tokenizers = None

CLASS_WORDS = (
    ("great", "superb", "lovely", "brilliant", "delight", "charming"),
    ("awful", "boring", "dreadful", "clumsy", "tedious", "weak"),
    ("plot", "actor", "scene", "camera", "script", "director"),
)
FILLER_WORDS = tuple(
    "the a an and or but so it this that was is are were of in on at to for with as by from very quite rather "
    "really just also then now here there some many few more most other such".split()
)
#: words the tokenizer does not know (they become [UNK]): what a shifted text uses instead of keywords
UNKNOWN_WORDS = ("splendid", "dismal", "lens", "marvellous", "dull", "cast")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def word_tokenizer() -> Any:
    """A whitespace word-level ``PreTrainedTokenizerFast`` over the keyword task's words (``[CLS] text [SEP]``).

    Example:
        >>> from posthoc_apps.demo.hf import word_tokenizer
        >>> word_tokenizer()(["a great plot"])["input_ids"]
        [[2, ..., 3]]
    """
    hf = require_transformers()
    vocab = {
        word: index
        for index, word in enumerate((*SPECIAL_TOKENS, *FILLER_WORDS, *(w for ws in CLASS_WORDS for w in ws)))
    }
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    core.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return hf.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=64,
    )


def keyword_texts(
    n: int, *, seed: int = 0, keywords: tuple[int, int] = (1, 3), unknown: float = 0.0, noise: float = 0.05
) -> tuple[list[str], list[int]]:
    """``n`` texts of the keyword task and their labels (see module docs); ``unknown`` is the chance that
    a keyword is replaced by a word the tokenizer does not know (a distribution shift).

    Example:
        >>> from posthoc_apps.demo.hf import keyword_texts
        >>> keyword_texts(2, seed=1)
        (['...', '...'], [..., ...])
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randrange(len(CLASS_WORDS))
        words = [rng.choice(FILLER_WORDS) for _ in range(rng.randint(6, 12))]
        signal = [rng.choice(CLASS_WORDS[label]) for _ in range(rng.randint(*keywords))]
        if rng.random() < 0.3:
            signal.append(rng.choice(CLASS_WORDS[rng.randrange(len(CLASS_WORDS))]))
        signal = [rng.choice(UNKNOWN_WORDS) if rng.random() < unknown else word for word in signal]
        for word in signal:
            words.insert(rng.randrange(len(words) + 1), word)
        texts.append(" ".join(words))
        labels.append(rng.randrange(len(CLASS_WORDS)) if rng.random() < noise else label)
    return texts, labels


def text_batches(
    texts: Sequence[str], labels: Sequence[int], tokenizer: Any, batch_size: int
) -> list[dict[str, Tensor]]:
    """Collator-style batches: the tokenizer's ``BatchEncoding`` padded per batch, with ``"labels"``."""
    batches = []
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(list(texts[start : start + batch_size]), padding=True, return_tensors="pt")
        encoded["labels"] = torch.tensor(labels[start : start + batch_size])
        batches.append(encoded)
    return batches


def tiny_bert(num_labels: int = len(CLASS_WORDS), *, seed: int = 0) -> nn.Module:
    """A random 2-layer ``BertForSequenceClassification`` (hidden size 32) for :func:`word_tokenizer`'s vocabulary."""
    hf = require_transformers()
    torch.manual_seed(seed)
    vocab = len(SPECIAL_TOKENS) + len(FILLER_WORDS) + sum(map(len, CLASS_WORDS))
    config = hf.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
    )
    return hf.BertForSequenceClassification(config).eval()


def tiny_vit(num_labels: int = 8, *, channels: int = 3, seed: int = 0) -> nn.Module:
    """A random 2-layer ``ViTForImageClassification`` (hidden size 32) for 28x28 digits (grey repeated to RGB)."""
    hf = require_transformers()
    torch.manual_seed(seed)
    config = hf.ViTConfig(
        image_size=28,
        patch_size=7,
        num_channels=channels,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
    )
    return hf.ViTForImageClassification(config).eval()


def rgb(dataset: TensorDataset) -> TensorDataset:
    """The bundled digits ``(N, 1, 28, 28)`` as 3-channel images (what an image processor's RGB conversion gives)."""
    x, y = dataset.tensors
    return TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), y)


def digits_processor() -> Any:
    """A ``ViTImageProcessor`` that turns digit images into :func:`tiny_vit`'s inputs (the digits' normalisation)."""
    hf = require_transformers()
    return hf.ViTImageProcessor(size={"height": 28, "width": 28}, image_mean=[MEAN] * 3, image_std=[STD] * 3)


def lora(model: nn.Module, *, rank: int = 4, targets: Sequence[str] = ("query", "value"), seed: int = 0) -> nn.Module:
    """``model`` with LoRA adapters on ``targets`` (its head trained beside them), as ``peft`` builds it."""
    peft = require_peft()
    torch.manual_seed(seed)
    config = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    return peft.get_peft_model(model, config)


def train(model: nn.Module, batches: Iterable[Any], *, steps: int, lr: float = 3e-3, seed: int = 0) -> nn.Module:
    """``steps`` AdamW steps of cross-entropy over ``batches`` (cycled; trainable parameters only); returns ``model`` in eval mode."""
    torch.manual_seed(seed)
    batches = list(batches)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        x, y = split_batch(batches[step % len(batches)])
        loss = nn.functional.cross_entropy(run_model(model, x), torch.as_tensor(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
