"""Which ``generate()`` calls get prompt-length and batch buckets, and how much padding each gets.

Decided once per call, when upstream prepares the KV cache (the generation
config is final there and the cache is not built yet). A call is bucketed
when it is a decoder-only greedy / sampling / beam-search call on Neuron with a
static cache and plain token inputs; anything else runs unpadded, on purpose,
with the reason logged at debug level:

- a cache the caller passed (its layout is theirs), ``prefill_chunk_size`` set by
  the caller, ``output_attentions`` / ``output_hidden_states`` (their shapes
  would show the padding), ``inputs_embeds``, model inputs beyond ids / mask /
  positions (images, audio), assisted or contrastive decoding;
- encoder-decoder models: their encoder length is bucketed instead
  (:func:`pad_encoder_inputs`), the decoder starts from one token.

Batch buckets (dummy rows) also need every forward of the call to run through
the compiled call (greedy or sampling, compile not disabled, model on one core).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import padding, shapes

logger = logging.getLogger("accelerate_neuron")

_PAD_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})
_ROW_MODES = frozenset({"greedy_search", "sample"})  # their decode runs through the compiled call
#: Model inputs the padded layout knows how to extend; a tensor under any other name turns bucketing off.
_KNOWN_TENSORS = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids", "cache_position"})

_announced = False


def max_positions(model: Any) -> int | None:
    try:
        config = model.config.get_text_config(decoder=True)
    except Exception:
        config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _returns_padded_shapes(generation_config: Any) -> bool:
    return any(getattr(generation_config, k, False) for k in ("output_attentions", "output_hidden_states"))


def _unbucketed_reason(model: Any, generation_config: Any, model_kwargs: dict[str, Any], mode: str) -> str | None:
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model (its encoder length is bucketed instead)"
    if getattr(generation_config, "cache_implementation", None) != "static":
        return "no static KV cache"
    if any(model_kwargs.get(k) is not None for k in ("cache", "past_key_values", "cache_params")):
        return "a cache passed by the caller"
    if mode not in _PAD_MODES or getattr(generation_config, "is_assistant", False):
        return f"generation mode {mode!r}"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size set by the caller"
    if _returns_padded_shapes(generation_config):
        return "attentions or hidden states requested (their shapes would show the padding)"
    others = sorted(k for k, v in model_kwargs.items() if isinstance(v, torch.Tensor) and k not in _KNOWN_TENSORS)
    if others:
        return f"model inputs {others} (only token ids, masks and positions are padded)"
    return None


def plan_call(
    model: Any,
    plan: padding.CallPlan,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    mode: str,
    compiles: bool,
) -> None:
    """Fill ``plan`` for a call on Neuron (``pad``, whether rows may be added); route its prefill to the compiled path.

    ``compiles``: whether the caller of this expects the decode step to be compiled (rows need it).
    """
    reason = _unbucketed_reason(model, generation_config, model_kwargs, mode)
    if reason is not None:
        logger.debug("accelerate_neuron: generate() prompt/batch buckets off for this call: %s", reason)
        return
    policy = shapes.resolve_policy(max_positions(model))
    if not policy.prompt_buckets and not policy.batch_buckets:
        return
    plan.policy = policy
    if policy.prompt_buckets:
        bucket = policy.prompt_bucket(plan.prompt)
        if bucket is None:
            shapes.warn_beyond_largest("prompt length", plan.prompt, policy.prompt_buckets, shapes.PROMPT_BUCKETS_ENV)
        elif plan.prompt > 1:  # a one-token prompt already has the decode step's shape
            plan.pad = bucket - plan.prompt
    # One chunk of the whole prompt: upstream then runs the prefill through the compiled call (both 4.x and
    # 5.x compile chunked prefills), one graph per bucket. 4.x prefills all but the last token there.
    if plan.prompt > 1 and hasattr(generation_config, "prefill_chunk_size"):
        generation_config.prefill_chunk_size = plan.prompt
        plan.chunked = True
    plan.may_add_rows = plan.chunked and bool(policy.batch_buckets) and mode in _ROW_MODES and compiles
    pad_id = getattr(model.config, "pad_token_id", None)
    vocab = getattr(model.config, "vocab_size", None)
    plan.filler = pad_id if isinstance(pad_id, int) and isinstance(vocab, int) and 0 <= pad_id < vocab else 0


def drop_rows(plan: padding.CallPlan, model_kwargs: dict[str, Any]) -> None:
    """Give up the dummy rows of a call that will not compile, and the cache built for them."""
    logger.debug("accelerate_neuron: generate() will not run compiled: batch buckets off for this call")
    plan.dummy = 0
    plan.may_add_rows = False
    for key in ("cache", "past_key_values"):
        model_kwargs.pop(key, None)


def announce(plan: padding.CallPlan) -> None:
    """One line, the first time a call is padded: what, and how to opt out."""
    global _announced
    if _announced or not plan.active or plan.policy is None:
        return
    _announced = True
    policy = plan.policy
    logger.warning(
        "accelerate_neuron: generate() on Neuron pads prompts to length buckets (%s) and batches to size buckets "
        "(%s), and compiles the prefill, so varied prompts reuse a few compiled graphs (this call: prompt %d -> %d "
        "tokens, batch %d -> %d rows; results are the unpadded ones). Opt out with %s=off and %s=off.",
        _short(policy.prompt_buckets),
        _short(policy.batch_buckets),
        plan.prompt,
        plan.prompt + plan.pad,
        plan.batch,
        plan.batch + plan.dummy,
        shapes.PROMPT_BUCKETS_ENV,
        shapes.BATCH_BUCKETS_ENV,
    )


def _short(values: tuple[int, ...]) -> str:
    if not values:
        return "off"
    if len(values) <= 5:
        return ", ".join(map(str, values))
    return f"{values[0]}, {values[1]}, {values[2]}, ... {values[-1]}"


# --- encoder-decoder models: the encoder input length ---------------------------------------------


def encoder_pad(inputs_tensor: Any, generation_config: Any) -> int:
    """Columns to append to the token input of an encoder on Neuron (0: leave it as it is)."""
    if not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() != 2 or inputs_tensor.is_floating_point():
        return 0
    if _returns_padded_shapes(generation_config):
        return 0
    policy = shapes.resolve_policy(None)
    length = inputs_tensor.shape[1]
    bucket = policy.prompt_bucket(length)
    if bucket is None:
        if policy.prompt_buckets:
            shapes.warn_beyond_largest("prompt length", length, policy.prompt_buckets, shapes.PROMPT_BUCKETS_ENV)
        return 0
    return bucket - length


def pad_encoder_inputs(
    inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any], pad: int, filler: int
) -> torch.Tensor:
    """Right-pad the encoder's ids (and its attention mask, 0 on the pad) by ``pad`` columns, in ``model_kwargs``."""
    rows = inputs_tensor.shape[0]
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(inputs_tensor.shape, dtype=torch.long, device=inputs_tensor.device)
    model_kwargs["attention_mask"] = torch.cat([mask, mask.new_zeros((rows, pad))], dim=-1)
    return torch.cat([inputs_tensor, inputs_tensor.new_full((rows, pad), filler)], dim=-1)
