"""A tiny causal language model trained here on texts the installed packages ship, and its LoRA-tuned copy.

No weights or corpora can be downloaded where posthoc is tested, so the token task is made from what any install
holds, three texts of different kinds (:func:`shipped_text`):

- ``"train"``: scipy's license file (``LICENSE.txt`` in its dist-info: legal English, BSD and the bundled licenses);
- ``"tune"``: PyTorch's long description (its README, Markdown prose, from ``importlib.metadata``);
- ``"shift"``: the docstrings of ``torch.nn.functional``'s public functions (reStructuredText API docs with maths).

Text becomes bytes (:func:`encode`: a byte-level tokenizer, vocabulary 256, so no text has an unknown token).
:func:`tiny_gpt2` is a random ``GPT2LMHeadModel`` (2 layers, width 64, context 64); :func:`train_lm` trains it for a
few hundred AdamW steps on the first text, :func:`lora_lm` adds ``peft`` LoRA adapters to its attention and
:func:`train_lm` tunes only them on the second.

**Labels are aligned to the logits.** :func:`token_batches` gives ``(input_ids, labels)`` pairs, both ``(N, T)``,
with ``labels[:, t]`` the token that FOLLOWS ``input_ids[:, t]`` (the target of the logits at position ``t``), and
``-100`` where no token follows (the text's last token, and the padding of the last window). Hugging Face causal LMs
shift labels inside ``forward(labels=...)``; these are already shifted: compare them with ``model(input_ids).logits``
``(N, T, V)`` position by position, never pass them as ``labels=`` to the model.

Example:
    >>> from posthoc_apps.demo.tokens import encode, split_ids, tiny_gpt2, token_batches, token_nll, train_lm
    >>> from posthoc_apps.demo.tokens import shipped_text, unigram_nll
    >>> fit, held_out = split_ids(encode(shipped_text("train")))
    >>> model = train_lm(tiny_gpt2(seed=0), token_batches(fit, shuffle=True, seed=0), steps=60)
    >>> input_ids, labels = token_batches(held_out)[0]
    >>> model(input_ids).logits.shape, labels.shape               # logits (N, T, V), labels (N, T)
    (torch.Size([32, 64, 256]), torch.Size([32, 64]))
    >>> bool((labels[:, :-1] == input_ids[:, 1:]).all())          # labels[:, t] is the token after input_ids[:, t]
    True
    >>> token_nll(model, token_batches(held_out)) < unigram_nll(fit, token_batches(held_out))   # nats per token
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posthoc_apps.loading.hf import require_peft, require_transformers

#: the byte-level vocabulary
VOCAB_SIZE = 256
#: the label of a position with no next token (Hugging Face's and PyTorch's ``ignore_index``)
IGNORE_INDEX = -100
#: positions per window (the model's context)
CONTEXT = 64
#: the most characters kept of a text (they are long; a few tens of thousands make seconds of training)
MAX_CHARS = 40_000
TEXTS = ("train", "tune", "shift")


def _license_text(distribution: str) -> str:
    files = importlib.metadata.distribution(distribution).files or []
    licenses = sorted(
        (f for f in files if f.name.upper().startswith("LICENSE") and ".dist-info" in str(f)), key=lambda f: len(str(f))
    )
    if not licenses:
        raise FileNotFoundError(f"{distribution} ships no LICENSE file in its dist-info")
    return licenses[0].read_text(encoding="utf-8")


def _functional_docs() -> str:
    import torch.nn.functional as F  # noqa: N812

    functions = (getattr(F, name) for name in sorted(dir(F)) if not name.startswith("_"))
    docs = (inspect.getdoc(f) for f in functions if inspect.isfunction(f) and f.__module__.startswith("torch"))
    return "\n\n".join(doc for doc in docs if doc and len(doc) > 200)


@functools.cache
def shipped_text(name: str) -> str:
    """One of the three texts (see module docs), at most :data:`MAX_CHARS` characters.

    Example:
        >>> from posthoc_apps.demo.tokens import shipped_text
        >>> [len(shipped_text(name)) > 5_000 for name in ("train", "tune", "shift")]
        [True, True, True]
    """
    if name == "train":
        text = _license_text("scipy")
    elif name == "tune":
        text = importlib.metadata.metadata("torch").get_payload() or importlib.metadata.metadata("torch")["Description"]
    elif name == "shift":
        text = _functional_docs()
    else:
        raise ValueError(f"the texts are {TEXTS}, not {name!r}")
    return text[:MAX_CHARS]


def encode(text: str) -> Tensor:
    """The UTF-8 bytes of ``text`` as token ids ``(L,)`` (int64, in ``[0, 256)``)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: Tensor | Sequence[int]) -> str:
    """Token ids back to text (bytes that are not valid UTF-8 become U+FFFD)."""
    return bytes(int(i) for i in ids if 0 <= int(i) < VOCAB_SIZE).decode("utf-8", errors="replace")


def split_ids(ids: Tensor, held_out: float = 0.2) -> tuple[Tensor, Tensor]:
    """The first ``1 - held_out`` of a token stream and the rest (contiguous: held-out text is text not trained on)."""
    cut = int(round(len(ids) * (1 - held_out)))
    return ids[:cut], ids[cut:]


def token_batches(
    ids: Tensor, *, context: int = CONTEXT, batch_size: int = 32, shuffle: bool = False, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """``(input_ids, labels)`` batches of non-overlapping windows of ``context`` tokens, labels aligned to the logits.

    ``labels[:, t]`` is the token after ``input_ids[:, t]`` in the stream (the window's last position takes the next
    window's first token), ``-100`` after the stream's last token; the last window is padded with token 0 and label
    ``-100``. ``shuffle`` permutes the windows (by ``seed``).

    Example:
        >>> import torch
        >>> from posthoc_apps.demo.tokens import token_batches
        >>> (x, y), = token_batches(torch.arange(1, 8), context=4)
        >>> x.tolist(), y.tolist()
        ([[1, 2, 3, 4], [5, 6, 7, 0]], [[2, 3, 4, 5], [6, 7, -100, -100]])
    """
    windows = math.ceil(len(ids) / context)
    inputs = torch.zeros(windows * context, dtype=torch.long)
    labels = torch.full((windows * context,), IGNORE_INDEX, dtype=torch.long)
    inputs[: len(ids)], labels[: len(ids) - 1] = ids, ids[1:]
    inputs, labels = inputs.view(windows, context), labels.view(windows, context)
    if shuffle:
        order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))
        inputs, labels = inputs[order], labels[order]
    return [(inputs[k : k + batch_size], labels[k : k + batch_size]) for k in range(0, windows, batch_size)]


def tiny_gpt2(*, seed: int = 0, context: int = CONTEXT, width: int = 64, layers: int = 2) -> nn.Module:
    """A random ``GPT2LMHeadModel`` over bytes (2 layers, 2 heads, width 64, context 64), in eval mode."""
    hf = require_transformers()
    torch.manual_seed(seed)
    config = hf.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return hf.GPT2LMHeadModel(config).eval()


def lora_lm(model: nn.Module, *, rank: int = 8, seed: int = 0) -> nn.Module:
    """``model`` with ``peft`` LoRA adapters on GPT-2's attention and MLP projections (only they train)."""
    peft = require_peft()
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's Conv1D stores its weight transposed
    )
    return peft.get_peft_model(model, config)


def logits_of(model: nn.Module, input_ids: Tensor) -> Tensor:
    """``model(input_ids).logits`` ``(N, T, V)`` (a plain tensor output is returned as it is)."""
    out = model(input_ids)
    return out.logits if hasattr(out, "logits") else out


def train_lm(
    model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], *, steps: int, lr: float = 3e-3, seed: int = 0
) -> nn.Module:
    """``steps`` AdamW steps of token cross-entropy (``-100`` ignored) over ``batches`` (cycled; trainable parameters
    only, so a LoRA model tunes its adapters); returns ``model`` in eval mode."""
    torch.manual_seed(seed)
    batches = list(batches)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        input_ids, labels = batches[step % len(batches)]
        logits = logits_of(model, input_ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def token_nll(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Mean negative log-likelihood (nats) per labelled token."""
    total, count = 0.0, 0
    for input_ids, labels in batches:
        logits = logits_of(model, input_ids)
        total += float(
            nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        )
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def unigram_nll(fit_ids: Tensor, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """The NLL per labelled token of the unigram model of ``fit_ids`` (byte frequencies, add-one smoothed): the
    baseline a language model must beat.

    Example:
        >>> import torch
        >>> from posthoc_apps.demo.tokens import token_batches, unigram_nll
        >>> ids = torch.tensor([1, 1, 1, 2] * 50)
        >>> round(unigram_nll(ids, token_batches(ids)), 3)     # mostly 1s: far below log(256) = 5.545
        1.378
    """
    counts = torch.bincount(fit_ids, minlength=VOCAB_SIZE).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    total, count = 0.0, 0
    for _, labels in batches:
        kept = labels[labels != IGNORE_INDEX]
        total, count = total - float(log_probs[kept].sum()), count + len(kept)
    return total / count


@functools.lru_cache(maxsize=2)
def token_task(seed: int = 0, *, steps: int = 200, lora_steps: int = 100) -> dict[str, Any]:
    """The whole token task, built once per ``seed``: the base model trained on ``"train"``, its LoRA copy tuned on
    ``"tune"``, and loaders of ``(input_ids, labels)``.

    Returns a dict with ``base`` (trained on the first text), ``lora`` (the LoRA-tuned ``peft`` model: it wraps a
    deep copy of ``base``), ``fit_ids`` / ``tune_ids`` (the token streams they trained on, the first 70 % of each
    text), and the loaders ``train_val`` / ``train_test`` (held-out 15 % + 15 % of the first text), ``tune_train``,
    ``tune_val``, ``tune_test`` (the second) and ``shift`` (the third text).
    """
    import copy

    train_ids, tune_ids = encode(shipped_text("train")), encode(shipped_text("tune"))
    fit_ids, rest = split_ids(train_ids, 0.3)
    train_val, train_test = split_ids(rest, 0.5)
    tune_fit, tune_rest = split_ids(tune_ids, 0.3)
    tune_val, tune_test = split_ids(tune_rest, 0.5)
    base = train_lm(
        tiny_gpt2(seed=seed), token_batches(fit_ids, batch_size=16, shuffle=True, seed=seed), steps=steps, seed=seed
    )
    tuned = train_lm(
        lora_lm(copy.deepcopy(base), seed=seed),
        token_batches(tune_fit, batch_size=16, shuffle=True, seed=seed),
        steps=lora_steps,
        seed=seed,
    )
    return {
        "base": base,
        "lora": tuned,
        "fit_ids": fit_ids,
        "tune_ids": tune_fit,
        "train_val": token_batches(train_val),
        "train_test": token_batches(train_test),
        "tune_train": token_batches(tune_fit),
        "tune_val": token_batches(tune_val),
        "tune_test": token_batches(tune_test),
        "shift": token_batches(encode(shipped_text("shift"))[: len(tune_val) * 2]),
    }
