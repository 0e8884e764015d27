"""Images and audio on Neuron with stock calls: the CPU's results, the batch bucketed, the forward compiled.

Tiny random models and processors built offline (:mod:`accelerate_neuron.tiny`): ViT with a classification head
through ``pipeline("image-classification")``, CLIP's and SigLIP's vision towers, wav2vec2 with a CTC head, Whisper
through ``generate(input_features=...)`` and ``pipeline("automatic-speech-recognition")``. An image or an audio
window has the size its processor gives it, so only the batch is padded (copies of the first row), to the batch
buckets text forwards use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from accelerate_neuron import tiny


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    yield
    torch._dynamo.reset()


def _same_predictions(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert [x["label"] for x in g] == [x["label"] for x in e]
        assert [x["score"] for x in g] == pytest.approx([x["score"] for x in e], abs=1e-5)


def test_image_classification_pipeline_gives_the_cpus_labels_with_one_graph_per_batch_bucket(
    tmp_path: Path, sim: Any
) -> None:
    folder = tiny.save_vision(tmp_path / "vit", "vit")
    images = tiny.images(5)
    expected = transformers.pipeline("image-classification", model=str(folder))(images)
    classifier = transformers.pipeline("image-classification", model=str(folder), device_map="auto")
    assert {p.device.type for p in classifier.model.parameters()} == {"neuron"}
    sim.reset_stats()
    _same_predictions(classifier(images), expected)  # one image per forward: batch bucket 1
    st = sim.stats()
    assert st["compiles"] == 1 and st["eager_signatures"] == 0
    _same_predictions(classifier(images, batch_size=3), expected)  # batches of 3 and 2: buckets 4 and 2
    st = sim.stats()
    assert st["compiles"] == 3 and st["eager_signatures"] == 0
    batches = [i["shape"][0] for g in st["graphs"] for i in g["dynamo_inputs"] if "pixel_values" in i["name"]]
    assert sorted(batches) == [1, 2, 4]
    _same_predictions(classifier(images[::-1], batch_size=3), expected[::-1])  # same buckets: nothing new
    assert sim.stats()["compiles"] == 3


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_a_vision_tower_gives_the_cpus_features_batch_bucketed(family: str, sim: Any) -> None:
    model = tiny.vision_model(family)
    on_neuron = tiny.vision_model(family).to("neuron")
    processor = tiny.image_processor(family)
    sim.reset_stats()
    for count in (3, 1, 4, 3):
        pixels = processor(tiny.images(count, seed=count), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            expected = model(pixel_values=pixels)
            got = on_neuron(pixel_values=pixels.to("neuron"))
        assert list(got.keys()) == list(expected.keys())
        for key in expected.keys():
            assert got[key].shape == expected[key].shape, key
            torch.testing.assert_close(got[key].cpu(), expected[key], rtol=1e-5, atol=1e-5, msg=key)
    st = sim.stats()
    assert st["compiles"] == 2  # batches 3, 1, 4, 3: buckets 4 and 1
    assert st["eager_signatures"] == 0


def test_wav2vec2_ctc_forward_gives_the_cpus_logits(sim: Any) -> None:
    model = tiny.speech_model("wav2vec2")
    on_neuron = tiny.speech_model("wav2vec2").to("neuron")
    extractor = tiny.feature_extractor("wav2vec2")
    sim.reset_stats()
    for count in (3, 4):
        batch = extractor(
            tiny.audio(count, seed=count), sampling_rate=tiny.SAMPLING_RATE, padding="max_length",
            max_length=tiny.SAMPLING_RATE, return_tensors="pt",
        )  # fmt: skip
        with torch.no_grad():
            expected = model(**batch).logits
            got = on_neuron(**{k: v.to("neuron") for k, v in batch.items()}).logits
        assert got.shape == expected.shape
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.cpu().argmax(-1), expected.argmax(-1))  # what CTC decoding reads
    st = sim.stats()
    assert st["compiles"] == 1  # batches 3 and 4 of one-second windows: bucket 4, one graph
    assert st["eager_signatures"] == 0


def test_whisper_generate_and_the_speech_recognition_pipeline_give_the_cpus_tokens(tmp_path: Path) -> None:
    folder = tiny.save_speech(tmp_path / "whisper", "whisper", init_std=0.3)
    audio = tiny.audio(3)
    cpu = transformers.pipeline("automatic-speech-recognition", model=str(folder))
    neuron = transformers.pipeline("automatic-speech-recognition", model=str(folder), device_map="auto")
    assert {p.device.type for p in neuron.model.parameters()} == {"neuron"}
    features = cpu.feature_extractor(audio, sampling_rate=tiny.SAMPLING_RATE, return_tensors="pt").input_features
    expected = cpu.model.generate(input_features=features, max_new_tokens=6, do_sample=False)
    got = neuron.model.generate(input_features=features.to("neuron"), max_new_tokens=6, do_sample=False)
    assert got.device.type == "neuron"  # back where the caller's inputs were
    assert got.cpu().tolist() == expected.tolist()
    assert len({tuple(row) for row in expected.tolist()}) > 1 or len(set(expected[0].tolist())) > 2  # not degenerate
    asked = {"generate_kwargs": {"max_new_tokens": 6}}
    assert neuron(audio, **asked) == cpu(audio, **asked)
