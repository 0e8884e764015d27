"""Every model family users run, on Neuron: stock `from_pretrained(device_map="auto")` + greedy `generate()` give the
CPU's tokens with every weight on the Neuron core.

Tiny random models (hidden 64, 2 layers, float32) built from each family's config; the families of
:data:`accelerate_neuron.tiny.FAMILIES` come from there, the others from the table below. A family added to
Transformers is not picked up by itself: add it here with its config's own size names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_neuron import tiny

_DECODER = tiny.DECODER_SIZES
_IDS = {"vocab_size": 512, **tiny.TOKEN_IDS}

#: model_type -> config keyword arguments, for the families :mod:`accelerate_neuron.tiny` does not build.
CONFIGS: dict[str, dict[str, Any]] = {
    "mistral": {**_DECODER, "sliding_window": None},
    "qwen2": _DECODER,
    "gemma2": {**_DECODER, "head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {**_DECODER, "head_dim": 16, "query_pre_attn_scalar": 16},
    "phi3": {**_DECODER, "original_max_position_embeddings": 256},
    "granite": _DECODER,
    "olmo2": _DECODER,
    "gpt_neox": {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},
    "opt": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "word_embed_proj_dim": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    },
    # hybrid: three Gated DeltaNet (linear attention, causal depthwise conv1d) layers, then full attention; MoE MLPs
    "qwen3_next": {
        **_DECODER,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    # chunked attention (chunks of 4: the 8-token prompt and its 6 new tokens span several), MoE MLPs
    "llama4_text": {
        **_DECODER,
        "intermediate_size_mlp": 128,
        "head_dim": 16,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "attention_chunk_size": 4,
    },
}
ENCODER_DECODER = set(tiny.ENCODER_DECODER_FAMILIES)
FAMILIES = sorted({*tiny.FAMILIES, *CONFIGS})


def _save(root: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    folder = root / family
    if family in tiny.FAMILIES:
        return tiny.save_pretrained(folder, family, initializer_range=0.3)
    config = AutoConfig.for_model(family, initializer_range=0.3, **_IDS, **CONFIGS[family])
    auto = AutoModelForSeq2SeqLM if family in ENCODER_DECODER else AutoModelForCausalLM
    torch.manual_seed(0)
    auto.from_config(config).eval().save_pretrained(folder)
    return folder


def _greedy(folder: Path, family: str, **load: Any) -> tuple[list[list[int]], set[str]]:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if family in ENCODER_DECODER else AutoModelForCausalLM
    model = auto.from_pretrained(folder, **load).eval()
    ids = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 8], [1, 0, 0, 12, 44, 9, 61, 30]])
    mask = torch.tensor([[1] * 8, [1, 0, 0, 1, 1, 1, 1, 1]])
    if family not in ENCODER_DECODER:  # a decoder-only batch is left-padded, as its tokenizer would
        ids, mask = ids[:, [1, 2, 0, 3, 4, 5, 6, 7]], mask[:, [1, 2, 0, 3, 4, 5, 6, 7]]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    return out.cpu().tolist(), {p.device.type for p in model.parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_on_neuron_gives_the_cpus_tokens(tmp_path: Path, family: str) -> None:
    folder = _save(tmp_path, family)
    expected, cpu_devices = _greedy(folder, family)
    assert cpu_devices == {"cpu"}
    tokens, devices = _greedy(folder, family, device_map="auto")
    assert devices == {"neuron"}, f"{family}: weights on {devices}"
    assert tokens == expected, family
    torch._dynamo.reset()


def test_llama4_text_decodes_compiled(tmp_path: Path, sim: Any) -> None:
    """Upstream's get_compiled_call declines Llama 4 (every release); on Neuron its decode step compiles anyway."""
    folder = _save(tmp_path, "llama4_text")
    expected, _ = _greedy(folder, "llama4_text")
    sim.reset_stats()
    tokens, _ = _greedy(folder, "llama4_text", device_map="auto")
    assert tokens == expected
    st = sim.stats()
    assert 1 <= st["compiles"] <= 3  # prefill and decode graphs, not op by op
    assert st["eager_signatures"] <= 10  # was 127 with upstream's uncompiled call
    torch._dynamo.reset()
