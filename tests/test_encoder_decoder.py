"""Encoder-decoder generate() compiled on Neuron: T5, BART and Whisper.

The encoder runs as one graph per (bucketed) input shape, the first decoder step (which fills the cross-attention
cache) and the later steps through the compiled call: three graphs on a cold call, none after, a handful of eager
signatures per call, flat as the number of new tokens grows, and the CPU's tokens. Stock upstream runs the encoder
and the first step op by op (T5: 115 eager signatures per call).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from accelerate_neuron import tiny

WORDS = "the neuron core runs the compiled graph and a static cache keeps every decode step the same shape".split()
#: Eager signatures left per warm call: the static cache's reset and length read (Transformers 4.x reuses one cache
#: between calls), the greedy pick, and Whisper's own bookkeeping on its device tensors (its prompt ids, the
#: segment of the log-mel window; 5.x: 8, 4.x: 18).
MAX_EAGER = {"t5": 10, "bart": 10, "whisper": 20}


@pytest.fixture(scope="module", autouse=True)
def _clean_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


def build(family: str):
    if family == "whisper":
        return tiny.speech_model("whisper", init_std=0.3)
    return tiny.model(family, **({"initializer_factor": 3.0} if family == "t5" else {}))


def inputs(family: str, tok, words: int) -> dict[str, torch.Tensor]:
    if family == "whisper":
        extractor = tiny.feature_extractor("whisper")
        audio = tiny.audio(1, seed=words)
        features = extractor(audio, sampling_rate=tiny.SAMPLING_RATE, return_tensors="pt").input_features
        return {"input_features": features}
    return dict(tok([" ".join(WORDS[:words])], return_tensors="pt"))


def on_neuron(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("neuron") for k, v in batch.items()}


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_generate_compiles_the_encoder_and_every_decoder_step_with_the_cpus_tokens(sim, tok, family):
    reference, model = build(family), build(family).to("neuron")
    greedy = {"do_sample": False}
    out = model.generate(**on_neuron(inputs(family, tok, 3)), max_new_tokens=3, **greedy)
    cold = sim.stats()
    # The encoder, the first decoder step (it fills the cross-attention cache), the decode step.
    assert cold["compiles"] == 3, [g["dynamo_inputs"][0]["name"] for g in cold["graphs"]]
    assert torch.equal(out.cpu(), reference.generate(**inputs(family, tok, 3), max_new_tokens=3, **greedy))
    eager, seen = [], set(out[0].tolist())
    for words, new_tokens in ((5, 4), (7, 12)):  # other prompt lengths in the same bucket, more tokens
        batch = inputs(family, tok, words)
        sim.reset_stats()
        out = model.generate(**on_neuron(batch), max_new_tokens=new_tokens, **greedy)
        st = sim.stats()
        expected = reference.generate(**batch, max_new_tokens=new_tokens, **greedy)
        assert out.device.type == "neuron"
        assert torch.equal(out.cpu(), expected), (family, words)
        assert st["compiles"] == 0 and st["compile_cache_hits"] == 0, st["graphs"]
        eager.append(st["eager_signatures"])
        seen.update(expected[0].tolist())
    assert len(seen) > 2, f"degenerate reference outputs: {seen}"
    assert eager[0] == eager[1], eager  # flat in the number of new tokens
    assert eager[0] <= MAX_EAGER[family], st["eager_signature_list"]


@pytest.mark.one_pair
def test_disable_compile_runs_the_encoder_and_first_step_eagerly(sim, tok):
    reference, model = build("bart"), build("bart").to("neuron")
    batch = inputs("bart", tok, 4)
    out = model.generate(**on_neuron(batch), max_new_tokens=4, do_sample=False, disable_compile=True)
    st = sim.stats()
    assert st["compiles"] == 0
    assert st["eager_signatures"] > 40  # every op of the encoder and of the decoder steps
    assert torch.equal(out.cpu(), reference.generate(**batch, max_new_tokens=4, do_sample=False))


def test_a_longer_input_compiles_its_own_bucket_once(sim, tok):
    """A new encoder bucket: its encoder graph (and the decoder graphs over its cross-attention length), once."""
    reference, model = build("t5"), build("t5").to("neuron")
    model.generate(**on_neuron(inputs("t5", tok, 3)), max_new_tokens=3, do_sample=False)
    long = dict(tok([" ".join(WORDS * 2)], return_tensors="pt"))
    assert long["input_ids"].shape[1] > 32  # beyond the first call's bucket (the smallest, 32)
    counts = []
    for _ in range(2):
        sim.reset_stats()
        out = model.generate(**on_neuron(long), max_new_tokens=4, do_sample=False)
        assert torch.equal(out.cpu(), reference.generate(**long, max_new_tokens=4, do_sample=False))
        counts.append(sim.stats()["compiles"])
    # At most the bucket's 3 graphs, once (fewer when Dynamo's graphs of an earlier test already cover the decoder's).
    assert 1 <= counts[0] <= 3 and counts[1] == 0, counts
