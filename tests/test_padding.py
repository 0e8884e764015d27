"""``accelerate_neuron.padding_stats()``: the positions each call family computed on Neuron, and the real ones.

Each figure is checked against what the call must have computed: the bucket's rows x columns against the
tokens the caller's attention mask keeps.
"""

from __future__ import annotations

import logging

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import padding, tiny
from accelerate_neuron.builtin.training.collate import BucketingCollator, Plan, pad_values_for
from accelerate_neuron.builtin.training.shapes import ShapePolicy


@pytest.fixture(autouse=True)
def _zeroed() -> None:
    accelerate_neuron.reset_padding_stats()


def test_generate_counts_its_prefill_against_the_tokens_the_mask_keeps(sim) -> None:
    torch._dynamo.reset()
    tok = tiny.tokenizer()
    tok.padding_side = "left"
    model = tiny.model("qwen3", initializer_range=0.3).to("neuron")
    enc = tok(["a b c d e f g h i j", "k l m"], return_tensors="pt", padding=True)
    real = int(enc["attention_mask"].sum())
    columns = enc["input_ids"].shape[1]
    model.generate(**enc, max_new_tokens=3, do_sample=False)
    stats = accelerate_neuron.padding_stats()
    # One prefill: 2 rows x 16 columns (the prompt bucket); 4.x prefills all but the last prompt token there.
    prefill, decode = stats["generate_prefill"], stats["generate_decode"]
    last = int(enc["attention_mask"][:, -1].sum())
    assert prefill in ({"computed": 2 * 16, "real": real}, {"computed": 2 * 15, "real": real - last}), prefill
    assert columns < 16
    steps = decode["real"] // 2
    assert decode == {"computed": 2 * steps, "real": 2 * steps} and steps in (2, 3)  # 4.x: +1 (the last token)
    accelerate_neuron.reset_padding_stats()
    assert all(v == {"computed": 0, "real": 0} for v in accelerate_neuron.padding_stats().values())


def test_inference_calls_count_the_bucket_against_the_callers_tokens(sim) -> None:
    tok = tiny.encoder_tokenizer()
    model = tiny.encoder("bert").eval().to("neuron")
    enc = tok(["one two three", "four five six seven eight nine"], return_tensors="pt", padding=True)
    with torch.no_grad():
        model(**{k: v.to("neuron") for k, v in enc.items()})
    assert enc["input_ids"].shape[1] in range(17, 25)
    assert accelerate_neuron.padding_stats()["forward"] == {
        "computed": 2 * 24,  # an inference call's built-in length buckets: pow2-half (16, 24, 32, ...)
        "real": int(enc["attention_mask"].sum()),
    }


def test_inference_calls_pad_to_the_halfway_bucket_unless_the_user_sets_pow2(sim, monkeypatch) -> None:
    """Two buckets an octave by default for inference calls: a 20-token row runs at 24 columns, not 32, and the
    caller gets the CPU's outputs; the user's ``pow2`` wins (32 columns)."""
    tok = tiny.encoder_tokenizer()
    text = " ".join(["one two three four five six seven eight nine"] * 4)
    enc = tok([text, "one two"], return_tensors="pt", padding=True, truncation=True, max_length=20)
    assert enc["input_ids"].shape[1] == 20
    reference = tiny.encoder("bert").eval()
    model = tiny.encoder("bert").eval().to("neuron")
    with torch.no_grad():
        got = model(**{k: v.to("neuron") for k, v in enc.items()}).last_hidden_state.cpu()
        want = reference(**enc).last_hidden_state
    assert accelerate_neuron.padding_stats()["forward"] == {
        "computed": 2 * 24,
        "real": int(enc["attention_mask"].sum()),
    }
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)

    accelerate_neuron.reset_padding_stats()
    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "pow2")
    with torch.no_grad():
        got = model(**{k: v.to("neuron") for k, v in enc.items()}).last_hidden_state.cpu()
    assert accelerate_neuron.padding_stats()["forward"]["computed"] == 2 * 32
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


@pytest.mark.one_pair
def test_training_batches_count_the_padded_length_against_the_mask() -> None:
    policy = ShapePolicy(buckets=(16,))

    def collate(features):
        return {
            "input_ids": torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        }

    BucketingCollator(collate, Plan(policy, pad_values_for(collate, policy)))([{}])
    assert accelerate_neuron.padding_stats()["training"] == {"computed": 2 * 16, "real": 7}


@pytest.mark.one_pair
def test_a_family_padding_above_twice_its_tokens_says_which_setting_helps_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        for _ in range(padding.WARN_AFTER - 1):
            padding.add("forward", 300, 100)
        assert not caplog.records  # a few calls are not a job yet
        for _ in range(5):
            padding.add("forward", 300, 100)
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 1
        and "3.00 positions per real one" in said[0]
        and "ACCELERATE_NEURON_PROMPT_BUCKETS=fit" in said[0]
    )
    with pytest.raises(ValueError, match="unknown call family 'prefill'"):
        padding.add("prefill", 1, 1)
