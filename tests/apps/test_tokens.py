"""The token task of :mod:`posthoc_apps.demo.tokens`: a tiny GPT-2 over bytes trained on scipy's license, LoRA-tuned
on PyTorch's README, with ``(input_ids, labels)`` loaders whose labels are aligned to the logits' positions.

The models must have learned something: their NLL per held-out token is below the unigram baseline (byte frequencies
of the text they trained on) by a margin a few hundred steps reach with room (measured: 2.62 vs 3.13 nats on the
license, 3.27 vs 3.60 after LoRA on the README), not by chance.
"""

from __future__ import annotations

import peft  # noqa: F401  (the LoRA copy needs it; it comes with posthoc[test])
import pytest
import torch

from posthoc_apps.demo import tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task():
    return tokens.token_task(0)


def test_base_model_beats_the_unigram_baseline_on_held_out_text(task) -> None:
    model_nll = tokens.token_nll(task["base"], task["train_test"])
    baseline = tokens.unigram_nll(task["fit_ids"], task["train_test"])
    assert model_nll < baseline - 0.2, (model_nll, baseline)


def test_lora_tuning_learns_the_second_text(task) -> None:
    before = tokens.token_nll(task["base"], task["tune_test"])
    after = tokens.token_nll(task["lora"], task["tune_test"])
    baseline = tokens.unigram_nll(task["tune_ids"], task["tune_test"])
    assert after < baseline - 0.1 and after < before - 0.2, (after, baseline, before)
    trainable = {name for name, p in task["lora"].named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)  # only the adapters were tuned
    base_weight = task["base"].transformer.h[0].attn.c_attn.weight
    tuned_weight = task["lora"].base_model.model.transformer.h[0].attn.c_attn.base_layer.weight
    assert torch.equal(base_weight, tuned_weight)  # the frozen copy is the base model's


def test_labels_are_the_next_tokens_at_the_logits_positions(task) -> None:
    stream_inputs = torch.cat([x for x, _ in task["tune_test"]]).flatten()
    stream_labels = torch.cat([y for _, y in task["tune_test"]]).flatten()
    labelled = stream_labels != tokens.IGNORE_INDEX
    count = int(labelled.sum())
    assert labelled[:count].all() and not labelled[count:].any()  # -100 only after the last token
    assert torch.equal(stream_labels[:count], stream_inputs[1 : count + 1])
    input_ids, labels = task["tune_test"][0]
    logits = task["lora"](input_ids).logits
    assert logits.shape == (*labels.shape, tokens.VOCAB_SIZE)


def test_deterministic_by_seed() -> None:
    ids = tokens.encode(tokens.shipped_text("train"))[:5000]
    first = tokens.train_lm(tokens.tiny_gpt2(seed=3), tokens.token_batches(ids, shuffle=True, seed=3), steps=3, seed=3)
    second = tokens.train_lm(tokens.tiny_gpt2(seed=3), tokens.token_batches(ids, shuffle=True, seed=3), steps=3, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    other = tokens.tiny_gpt2(seed=4)
    assert not torch.equal(next(other.parameters()), next(tokens.tiny_gpt2(seed=3).parameters()))


def test_the_three_texts_differ_and_round_trip() -> None:
    texts = [tokens.shipped_text(name) for name in tokens.TEXTS]
    assert len(set(texts)) == 3 and all(len(text) > 5000 for text in texts)
    assert tokens.decode(tokens.encode(texts[0])) == texts[0]
    with pytest.raises(ValueError, match="the texts are"):
        tokens.shipped_text("other")
