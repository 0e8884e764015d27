"""Image-text-to-text on Neuron: a tiny Qwen2-VL loaded with ``device_map="auto"`` generates from an image the CPU's
tokens, its vision tower and language model both on the Neuron core.

Qwen2-VL is in every supported Transformers release; its vision tower embeds patches with a 3-D convolution
(temporal x height x width), which the simulated device runs like the CPU. The prompt is built as Qwen2-VL's
processor builds it (vision start, one image token per merged patch, vision end) from the image processor's grid.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from accelerate_neuron import tiny

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503


def _save_qwen2_vl(folder: Path) -> Path:
    config = transformers.Qwen2VLConfig(
        text_config={
            **tiny.DECODER_SIZES,
            "vocab_size": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": tiny.DECODER_SIZES["hidden_size"],
            "num_heads": 4,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    transformers.Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _inputs() -> dict[str, torch.Tensor]:
    processor = transformers.Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    image = processor(tiny.images(1), return_tensors="pt")
    merged = int(image["image_grid_thw"].prod()) // 4  # merge_size ** 2 patches per image token
    ids = torch.tensor([[1, 5, 17, VISION_START] + [IMAGE_TOKEN] * merged + [VISION_END, 42, 7, 99]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **image}


def test_a_tiny_vlm_generates_from_an_image_the_cpus_tokens(tmp_path: Path, sim: object) -> None:
    folder = _save_qwen2_vl(tmp_path / "qwen2_vl")
    inputs = _inputs()
    cpu = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder).eval()
    expected = cpu.generate(**inputs, max_new_tokens=6, do_sample=False)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder, device_map="auto").eval()
    assert {p.device.type for p in model.parameters()} == {"neuron"}  # vision tower and language model
    sim.reset_stats()
    got = model.generate(**{k: v.to(model.device) for k, v in inputs.items()}, max_new_tokens=6, do_sample=False)
    assert got.cpu().tolist() == expected.tolist()
    assert len(set(expected[0, -6:].tolist())) > 1  # not one token repeated: the image and prompt steer it
    assert [s for s in sim.stats()["eager_signature_list"] if "convolution" in s]  # the patch embedding ran here
    torch._dynamo.reset()
