"""The shape layer (``builtin/shapes``): bucket sets, their bounds, the pad values and the pad token id.

Every capability pads through it, so what is checked here holds for generate(), inference calls,
training batches and continuous batching alike; the capabilities' own tests check their results
against the CPU's.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from accelerate_neuron import hookimpl, plugins, settings, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.training.collate import pad_values_for
from accelerate_neuron.builtin.training.shapes import ShapePolicy, pad_batch, resolve_policy

PROMPT_ENV = "ACCELERATE_NEURON_PROMPT_BUCKETS"


@pytest.mark.one_pair
def test_a_bucket_set_picks_the_smallest_bucket_and_says_once_when_none_holds(caplog) -> None:
    buckets = shapes.Buckets((32, 64), "prompt_buckets")
    assert [buckets.at_least(n) for n in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, None]
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert [buckets.pad_to(n, "generate()", "prompt length") for n in (3, 33, 70, 70)] == [32, 64, 70, 70]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "generate() got a prompt length of 70, more than the largest bucket (64)" in said[0]
    assert PROMPT_ENV in said[0]
    assert shapes.Buckets((), "prompt_buckets").pad_to(5, "generate()", "prompt length") == 5  # off: as is
    assert buckets == (32, 64) and pickle.loads(pickle.dumps(buckets)).setting == "prompt_buckets"
    for bad in ((64, 32), (0, 8), (8, 2**31)):
        with pytest.raises(ValueError, match="strictly ascending ints from 1 to 2147483647"):
            shapes.Buckets(bad)


@pytest.mark.one_pair
def test_power_of_two_lists_end_at_their_limit() -> None:
    assert shapes.pow2(32, 100) == (32, 64, 100)
    assert shapes.pow2(32, 16) == (16,)  # a model shorter than the first bucket: its own length
    assert shapes.pow2_batch_buckets() == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert shapes.pow2_prompt_buckets(None)[-1] == 8192
    assert shapes.round_up_pow2(65, 64) == 128 and shapes.round_up_pow2(3, 64) == 64
    assert shapes.Buckets((16, 64)).ending_at(512) == (16, 64, 512)  # a step budget is always a bucket
    assert shapes.Buckets((16, 1024)).ending_at(512) == (16, 512)


@pytest.mark.one_pair
def test_a_user_bucket_beyond_the_models_positions_is_capped_naming_both(monkeypatch, caplog) -> None:
    """Issue 34, finding 6: 100000 on a 256-position model used to pad prompts to 100000 (memory exhausted)."""
    monkeypatch.setenv(PROMPT_ENV, "64,100000")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        policy = shapes.resolve_policy(256)
        assert shapes.resolve_policy(256) == policy
    assert policy.prompt_buckets == (64, 256)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "100000" in said[0] and "max_position_embeddings (256)" in said[0], said
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128,100000")
    assert resolve_policy(512).buckets == (128, 512)  # training: the same cap


@pytest.mark.one_pair
@pytest.mark.parametrize("name", ["prompt_buckets", "batch_buckets", "cache_buckets", "train_buckets"])
def test_a_bucket_past_what_a_shape_holds_is_refused_where_it_is_set(name, monkeypatch) -> None:
    """``99999999999999999999`` used to reach ``torch.zeros`` and fail there with a TypeError."""
    env = settings.env_name(name)
    monkeypatch.setenv(env, "99999999999999999999")
    with pytest.raises(settings.SettingError, match=rf"{env}='99999999999999999999'.*larger than 2147483647"):
        settings.get(name)
    monkeypatch.delenv(env)

    class Huge:
        @hookimpl
        def neuron_generation_shape_policy(self, max_position_embeddings):
            return {"prompt_buckets": [2**40]}

    with plugins.registered(Huge(), "test-huge-buckets"), pytest.raises(ValueError, match="larger than 2147483647"):
        shapes.resolve_policy(256)


def test_generate_with_a_prompt_bucket_beyond_the_models_positions_matches_cpu(sim, monkeypatch, caplog) -> None:
    torch._dynamo.reset()
    tok = tiny.tokenizer()
    cpu = tiny.model("qwen3", initializer_range=0.3)
    model = tiny.model("qwen3", initializer_range=0.3).to("neuron")
    monkeypatch.setenv(PROMPT_ENV, "100000")
    enc = tok(["the quick brown fox jumps over"], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), cpu.generate(**enc, max_new_tokens=4, do_sample=False))
    widths = {
        x["shape"][1]
        for g in sim.stats()["graphs"]
        for x in g["dynamo_inputs"]
        if x["name"].endswith("['input_ids']") and x["shape"][1] > 1
    }
    # The prefill padded to the model's 256 positions, not to 100000 (4.x prefills all but the last token there).
    assert widths in ({256}, {255}), widths
    assert any("100000" in r.getMessage() and "(256)" in r.getMessage() for r in caplog.records)


@pytest.mark.one_pair
def test_position_pads_never_join_a_real_sequence() -> None:
    """Why ``position_ids`` pads with 0 on either side (generate() used to pad with 1 on the left).

    Where a model reads sequence boundaries from the positions (a padding-free batch without a mask),
    a 0 starts a sequence of its own: a pad is never part of a real one. A 1 after a one-token sequence
    (position 0) would continue it.
    """
    fill = shapes.PAD_VALUES["position_ids"]
    assert fill == 0
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])  # three sequences flattened into one row; the last is one token
    real = find_packed_sequence_indices(packed)[0].tolist()
    for left in (False, True):
        groups = find_packed_sequence_indices(shapes.pad_columns(packed, 10, fill, left=left))[0].tolist()
        pads, kept = (groups[:4], groups[4:]) if left else (groups[6:], groups[:6])
        assert len(set(pads)) == 4 and not set(pads) & set(kept), groups  # every pad a sequence of its own
        assert [g - kept[0] for g in kept] == [g - real[0] for g in real]  # the real sequences as they were
    ones = find_packed_sequence_indices(shapes.pad_columns(packed, 10, 1))[0].tolist()
    assert ones[5] == ones[6]  # with 1: the first pad joins the one-token sequence before it

    # Training pads a padding-free batch the same way (positions present, no mask).
    policy = ShapePolicy(buckets=(8,))
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 4]]), "position_ids": packed.clone(), "labels": packed.clone()}
    padded = pad_batch(batch, policy, pad_values_for(None, policy))
    assert padded["position_ids"][0, 6:].tolist() == [0, 0] and padded["labels"][0, 6:].tolist() == [-100, -100]


@pytest.mark.one_pair
def test_one_pad_token_choice() -> None:
    config = tiny.config("qwen3")
    config.pad_token_id = None
    assert shapes.pad_id(config, vocab=config.vocab_size) == 0  # nothing names one: any valid id does
    config.pad_token_id = config.vocab_size + 3  # not an id of this vocabulary: never used
    config.eos_token_id = [7, 8]
    assert shapes.pad_id(config, vocab=config.vocab_size) == 0
    assert shapes.pad_id(config, vocab=config.vocab_size, names=("pad_token_id", "eos_token_id")) == 7
    tok = tiny.tokenizer()
    assert shapes.pad_id(tok, config, vocab=config.vocab_size) == tok.pad_token_id  # the first source that has one
    values = shapes.pad_values(9, pad_type=2)
    assert values["input_ids"] == values["decoder_input_ids"] == 9 and values["token_type_ids"] == 2
    assert values["labels"] == -100 and values["attention_mask"] == 0
