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

FAMILIES = ("qwen3", "llama", "gpt2", "t5", "qwen3_moe", "mixtral")
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
    common = {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return AutoConfig.for_model(model_type, **{**DECODER_SIZES, **common, **MOE_CONFIGS[model_type], **overrides})


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


def config(family: str = "qwen3", vocab_size: int = 512, **overrides: Any) -> Any:
    """A toy-size config of ``family`` (one of :data:`FAMILIES`)."""
    import transformers

    common = {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "qwen3":
        cls, kwargs = (
            transformers.Qwen3Config,
            {
                **DECODER_SIZES,
                "head_dim": 16,
                "tie_word_embeddings": True,
                **common,
            },
        )
    elif family == "llama":
        cls, kwargs = (
            transformers.LlamaConfig,
            {
                **DECODER_SIZES,
                **common,
            },
        )
    elif family == "gpt2":
        cls, kwargs = (
            transformers.GPT2Config,
            {
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 256,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                **common,
            },
        )
    elif family == "qwen3_moe":
        cls, kwargs = (
            transformers.Qwen3MoeConfig,
            {
                **DECODER_SIZES,
                "moe_intermediate_size": 64,
                "head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "tie_word_embeddings": True,
                **common,
            },
        )
    elif family == "mixtral":
        cls, kwargs = (
            transformers.MixtralConfig,
            {
                **DECODER_SIZES,
                "intermediate_size": 64,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                **common,
            },
        )
    elif family == "t5":
        cls, kwargs = (
            transformers.T5Config,
            {
                "d_model": 64,
                "d_kv": 16,
                "d_ff": 128,
                "num_layers": 2,
                "num_decoder_layers": 2,
                "num_heads": 4,
                "dropout_rate": 0.0,
                "decoder_start_token_id": 0,
                "vocab_size": vocab_size,
                "pad_token_id": 0,
                "eos_token_id": 2,
            },
        )
    else:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {', '.join(FAMILIES)}")
    # Overrides go through the constructor so derived fields (e.g. Qwen3's
    # layer_types) follow them.
    return cls(**{**kwargs, **overrides})


def model(family: str = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised toy model of ``family`` on CPU, in eval mode."""
    import torch
    import transformers

    cfg = config(family, **overrides)
    torch.manual_seed(seed)
    if family == "t5":
        m = transformers.T5ForConditionalGeneration(cfg)
    else:
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    return m.eval()


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
