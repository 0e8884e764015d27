"""Tiny models and tokenizers built in-process: no hub access, no downloaded weights.

Used by the demo, the tests and the benchmarks. Shapes follow real families
(Qwen3, Llama, GPT-2, T5) at toy size; weights are random with a fixed seed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CORPUS = (
    "the neuron core runs the compiled graph . "
    "a static cache keeps every decode step the same shape . "
    "trainium chips have many neuron cores and fast memory . "
    "hugging face models load with device map auto . "
    "generate keeps growing tensors on the host . "
    "compiles not flops decide wall time on neuron . "
    "hello world , this is a tiny model that talks about accelerators . "
)

FAMILIES = ("qwen3", "llama", "gpt2", "t5", "bart", "qwen3_moe", "mixtral")
#: Mixture-of-experts families among :data:`FAMILIES` (4 experts, top-2).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
#: Encoder families :func:`encoder` builds (bidirectional models with heads for classification, tokens, masks, QA).
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "deberta-v2", "electra", "mpnet", "modernbert")


#: The sizes every tiny decoder-only model shares (a family's config may override or add to them).
DECODER_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


#: Every mixture-of-experts family a Trainium user runs, at toy size (model_type -> config keyword arguments on top of
#: :data:`DECODER_SIZES`): 8 experts, top-2 (Llama 4: top-1, as the family is), so a prefill of 4 tokens or more
#: routes at least as many (token, expert) pairs as there are experts (the blockwise path) and a decode step of a
#: batch of 2 fewer (the gathered path). :func:`moe_config` builds them; a release without the family raises.
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {  # a shared expert with its own sigmoid gate
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "olmoe": {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": {  # shared experts, grouped routing, MLA attention, a dense first layer
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    "gpt_oss": {  # attention sinks, sliding-window layers, biased experts with a clamped SwiGLU
        "intermediate_size": 32,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "glm4_moe": {  # shared experts, a dense first layer
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "llama4_text": {  # top-1 with a sigmoid score applied to the expert's input, a shared expert
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
    },
    "qwen3_next": {  # hybrid linear attention (a gated delta net with a causal conv1d) and a shared expert
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"],
    },
}


def moe_config(model_type: str, vocab_size: int = 512, **overrides: Any) -> Any:
    """A toy-size config of MoE family ``model_type`` (a key of :data:`MOE_CONFIGS`).

    Raises ``ValueError`` when the installed Transformers does not have the family.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in MOE_CONFIGS:
        raise ValueError(f"unknown tiny MoE family {model_type!r}; expected one of {', '.join(MOE_CONFIGS)}")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"this Transformers release has no {model_type!r} models")
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, **{**DECODER_SIZES, **TOKEN_IDS, **MOE_CONFIGS[model_type], **overrides}
    )


def tokenizer(vocab_size: int = 384) -> Any:
    """A small byte-level BPE fast tokenizer trained on :data:`CORPUS` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        # Like the Qwen/Llama tokenizers it stands in for; 4.57's default adds
        # token_type_ids, which decoder-only generate() rejects.
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.padding_side = "left"
    return fast


#: The ids every tiny model shares (pad 0, bos 1, eos 2: the tiny tokenizer's).
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

#: :data:`FAMILIES` at toy size: model_type -> config keyword arguments (on top of :data:`TOKEN_IDS`).
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {**DECODER_SIZES, "head_dim": 16, "tie_word_embeddings": True},
    "llama": DECODER_SIZES,
    "gpt2": {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "qwen3_moe": {
        **DECODER_SIZES,
        "moe_intermediate_size": 64,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "tie_word_embeddings": True,
    },
    "mixtral": {**DECODER_SIZES, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    "t5": {
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "dropout_rate": 0.0,
        "decoder_start_token_id": 0,
        "bos_token_id": None,  # T5 has none
    },
    "bart": {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_position_embeddings": 256,
        "dropout": 0.0,
        "scale_embedding": True,
        "init_std": 1.0,  # BART's default spread gives one repeated token at this size
        "decoder_start_token_id": 2,
        "forced_eos_token_id": None,
    },
}
#: The encoder-decoder families among :data:`FAMILIES` (built with ``AutoModelForSeq2SeqLM``).
ENCODER_DECODER_FAMILIES = ("t5", "bart")


def config(family: str = "qwen3", vocab_size: int = 512, **overrides: Any) -> Any:
    """A toy-size config of ``family`` (one of :data:`FAMILIES`)."""
    from transformers import AutoConfig

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {', '.join(FAMILIES)}")
    # Overrides go through the constructor so derived fields (e.g. Qwen3's layer_types) follow them.
    return AutoConfig.for_model(family, vocab_size=vocab_size, **{**TOKEN_IDS, **FAMILY_CONFIGS[family], **overrides})


def model(family: str = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised toy model of ``family`` on CPU, in eval mode."""
    import torch
    import transformers

    cfg = config(family, **overrides)
    torch.manual_seed(seed)
    auto = (
        transformers.AutoModelForSeq2SeqLM if family in ENCODER_DECODER_FAMILIES else transformers.AutoModelForCausalLM
    )
    return auto.from_config(cfg).eval()


def save_pretrained(path: str | os.PathLike[str], family: str = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny model (safetensors) and its tokenizer to ``path``; return the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model(family, seed=seed, **overrides).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def encoder_tokenizer() -> Any:
    """:func:`tokenizer` as an encoder's: padded on the right, with mask/CLS/SEP tokens and token type ids."""
    tok = tokenizer()
    tok.add_special_tokens({"mask_token": "<|mask|>", "cls_token": "<|bos|>", "sep_token": "<|eos|>"})
    tok.padding_side = "right"
    tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    return tok


def encoder_config(family: str = "bert", vocab_size: int = 512, **overrides: Any) -> Any:
    """A toy-size config of encoder ``family`` (one of :data:`ENCODERS`): 2 layers, hidden size 64."""
    import transformers

    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
    }
    classes = {
        "bert": (transformers.BertConfig, {}),
        "roberta": (transformers.RobertaConfig, {}),
        "xlm-roberta": (transformers.XLMRobertaConfig, {}),
        "deberta-v2": (transformers.DebertaV2Config, {}),
        "electra": (transformers.ElectraConfig, {"embedding_size": 64}),
        "mpnet": (transformers.MPNetConfig, {}),
        "modernbert": (
            transformers.ModernBertConfig,
            {
                "global_attn_every_n_layers": 1,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "cls_token_id": 1,
                "sep_token_id": 2,
            },
        ),
    }
    if family == "distilbert":
        cls, kwargs = (
            transformers.DistilBertConfig,
            {
                "vocab_size": vocab_size,
                "dim": 64,
                "n_layers": 2,
                "n_heads": 4,
                "hidden_dim": 128,
                "max_position_embeddings": 256,
                "pad_token_id": 0,
            },
        )
    elif family in classes:
        cls, extra = classes[family]
        kwargs = {**sizes, **extra}
    else:
        raise ValueError(f"unknown tiny encoder family {family!r}; expected one of {', '.join(ENCODERS)}")
    return cls(**{**kwargs, **overrides})


def encoder(family: str = "bert", head: str = "AutoModel", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised toy encoder of ``family`` with ``head`` (a Transformers ``Auto*`` class name)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, head).from_config(encoder_config(family, **overrides)).eval()


def save_encoder(path: str | os.PathLike[str], family: str = "bert", head: str = "AutoModel", **overrides: Any) -> Path:
    """Write a tiny encoder and :func:`encoder_tokenizer` to ``path`` (for sentence-transformers, pipelines)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    encoder(family, head, **overrides).save_pretrained(folder)
    encoder_tokenizer().save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ images and audio

#: Vision families :func:`vision_model` builds (32x32 images, 8x8 patches).
VISION = ("vit", "clip", "siglip")
#: Speech families :func:`speech_model` builds (16 kHz audio).
SPEECH = ("whisper", "wav2vec2")
IMAGE_SIZE = 32
SAMPLING_RATE = 16_000
#: Whisper's window here: 1 s of audio (100 log-mel frames), where real checkpoints take 30 s.
WHISPER_SECONDS = 1
#: The special tokens Whisper's decoding looks up by name; ids after ``<|notimestamps|>`` would be timestamps.
WHISPER_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|transcribe|>",
    "<|translate|>",
    "<|notimestamps|>",
)


def vision_config(family: str = "vit", **overrides: Any) -> Any:
    """A toy-size vision config of ``family`` (one of :data:`VISION`): 2 layers, hidden size 32."""
    import transformers

    sizes = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": 8,
    }
    classes = {
        "vit": (transformers.ViTConfig, {"num_labels": 3}),
        "clip": (transformers.CLIPVisionConfig, {"projection_dim": 16}),
        "siglip": (transformers.SiglipVisionConfig, {}),
    }
    if family not in classes:
        raise ValueError(f"unknown tiny vision family {family!r}; expected one of {', '.join(VISION)}")
    cls, extra = classes[family]
    return cls(**{**sizes, **extra, **overrides})


def vision_model(family: str = "vit", head: str | None = None, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised toy vision model: ViT with an image-classification head, CLIP's vision tower with its
    projection, SigLIP's vision tower (``head``: another Transformers class name of the family)."""
    import torch
    import transformers

    default = {
        "vit": "ViTForImageClassification",
        "clip": "CLIPVisionModelWithProjection",
        "siglip": "SiglipVisionModel",
    }
    cfg = vision_config(family, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, head or default[family])(cfg).eval()


def image_processor(family: str = "vit") -> Any:
    """The image processor of ``family`` at :data:`IMAGE_SIZE` (PIL-based: no torchvision needed)."""
    import transformers

    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if family == "clip":
        return transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=size)
    if family == "siglip":
        return transformers.SiglipImageProcessor(size=size)
    return transformers.ViTImageProcessor(size=size)


def images(count: int, seed: int = 0, size: tuple[int, int] = (48, 40)) -> list[Any]:
    """``count`` random RGB PIL images of ``size`` (width, height): the processor resizes them."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count)]


def save_vision(path: str | os.PathLike[str], family: str = "vit", head: str | None = None, **overrides: Any) -> Path:
    """Write a tiny vision model and its image processor to ``path`` (for pipelines, ``from_pretrained``)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    vision_model(family, head, **overrides).save_pretrained(folder)
    image_processor(family).save_pretrained(folder)
    return folder


def speech_config(family: str = "whisper", **overrides: Any) -> Any:
    """A toy-size speech config of ``family`` (one of :data:`SPEECH`)."""
    import transformers

    if family == "whisper":
        frames = WHISPER_SECONDS * 100  # log-mel frames at a 160-sample hop
        kwargs = {
            "vocab_size": 384 + len(WHISPER_SPECIAL_TOKENS),  # :func:`whisper_tokenizer`'s: every id decodes
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "num_mel_bins": 16,
            "max_source_positions": frames // 2,  # the encoder's second conv has stride 2
            "max_target_positions": 448,  # the ASR pipeline asks for up to 256 new tokens, as real Whisper has room for
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 1,
            "begin_suppress_tokens": None,
            "suppress_tokens": None,
        }
        return transformers.WhisperConfig(**{**kwargs, **overrides})
    if family == "wav2vec2":
        kwargs = {
            "vocab_size": 32,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "conv_dim": (16, 16),
            "conv_stride": (5, 2),
            "conv_kernel": (10, 3),
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
            "feat_extract_norm": "layer",  # the -lv60 variants': takes an attention mask over the samples
            "do_stable_layer_norm": True,
            "pad_token_id": 0,
        }
        return transformers.Wav2Vec2Config(**{**kwargs, **overrides})
    raise ValueError(f"unknown tiny speech family {family!r}; expected one of {', '.join(SPEECH)}")


def speech_model(family: str = "whisper", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised toy speech model: Whisper for generation, wav2vec2 with a CTC head."""
    import torch
    import transformers

    cfg = speech_config(family, **overrides)
    torch.manual_seed(seed)
    cls = transformers.WhisperForConditionalGeneration if family == "whisper" else transformers.Wav2Vec2ForCTC
    return cls(cfg).eval()


def feature_extractor(family: str = "whisper") -> Any:
    """The feature extractor of ``family``: Whisper's log-mel (16 bins, :data:`WHISPER_SECONDS` window), or
    wav2vec2's normalised waveform with an attention mask."""
    import transformers

    if family == "whisper":
        return transformers.WhisperFeatureExtractor(
            feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=WHISPER_SECONDS
        )
    return transformers.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=SAMPLING_RATE, do_normalize=True, return_attention_mask=True
    )


def whisper_tokenizer() -> Any:
    """:func:`tokenizer`'s vocabulary as a Whisper tokenizer (what the speech-recognition pipeline decodes with)."""
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        tok = transformers.WhisperTokenizerFast(
            tokenizer_file=str(Path(folder) / "tokenizer.json"),
            bos_token="<|bos|>",
            eos_token="<|eos|>",
            pad_token="<|pad|>",
            unk_token="<|pad|>",
        )
    tok.add_special_tokens({"additional_special_tokens": list(WHISPER_SPECIAL_TOKENS)})
    return tok


def audio(count: int, seed: int = 0, seconds: tuple[float, float] = (0.3, 0.9)) -> list[Any]:
    """``count`` float32 waveforms at :data:`SAMPLING_RATE` of random lengths in ``seconds``: tones plus noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.uniform(*seconds) * SAMPLING_RATE)
        t = np.arange(n) / SAMPLING_RATE
        wave = 0.5 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.05 * rng.standard_normal(n)
        out.append(wave.astype(np.float32))
    return out


def save_speech(path: str | os.PathLike[str], family: str = "whisper", **overrides: Any) -> Path:
    """Write a tiny speech model, its feature extractor (and Whisper's tokenizer) to ``path``."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    speech_model(family, **overrides).save_pretrained(folder)
    feature_extractor(family).save_pretrained(folder)
    if family == "whisper":
        whisper_tokenizer().save_pretrained(folder)
    return folder
