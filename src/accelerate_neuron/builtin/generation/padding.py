"""The padded layout of a bucketed ``generate()`` call: what only the model's forward passes see.

What a call pads is decided by its :class:`~.call.GenerateCall`; the tensor
work is here. Upstream's loop keeps working on the caller's own tensors, so
only the forward passes see padded shapes:

- ``pad`` columns are prepended to every forward's ``input_ids`` /
  ``attention_mask`` (0 there) / ``position_ids`` (the caller's positions are
  kept: a left pad never moves a real token) and, on Transformers 4.x,
  ``cache_position`` (shifted by ``pad``). The static KV cache holds the pad
  slots at its start, masked out for every query.
- ``dummy`` rows (copies of row 0, so no row is ever fully masked) are appended
  to every forward's batch and cut from the logits before upstream reads them;
  they only exist when every forward of the call runs through the compiled
  call (where the cut is made), never on an eager path.
- The prefill runs as one chunk through upstream's own compiled-prefill path
  (``prefill_chunk_size``), so it is compiled like the decode step: one graph
  per (prompt bucket, batch bucket), one per (cache bucket, batch bucket).
  Transformers 4.x's chunked path numbers positions ``0..n-1`` whatever the
  caller's left padding; its arange is dropped on every chunked call, padded
  by us or not, so positions come from the mask as in the unchunked call.
- An encoder-decoder model's encoder input is right-padded to a prompt
  bucket instead (:func:`encoder_pad`), its mask 0 there.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch

from ... import logs
from . import shapes

if TYPE_CHECKING:
    from .call import GenerateCall

logger = logging.getLogger(__name__)

#: Tensors of a decoder forward whose last dimension is the sequence (the columns ``pad`` extends).
_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
_PAD_VALUE = {"attention_mask": 0, "position_ids": 1, "token_type_ids": 0}  # 1: upstream's own fill for pads


def returns_padded_shapes(generation_config: Any) -> bool:
    """Whether the call returns per-position tensors (attentions, hidden states) that would show the padding."""
    return any(getattr(generation_config, k, False) for k in ("output_attentions", "output_hidden_states"))


def _cat_columns(value: torch.Tensor, pad: int, fill: int) -> torch.Tensor:
    shape = (*value.shape[:-1], pad)
    return torch.cat([torch.full(shape, fill, dtype=value.dtype, device=value.device), value], dim=-1)


def _add_rows(value: torch.Tensor, batch: int, dummy: int) -> torch.Tensor:
    if value.dim() == 0 or value.shape[0] != batch:
        return value  # not batched (e.g. a [1, n] position row shared by every row)
    return torch.cat([value, value[:1].expand(dummy, *value.shape[1:])], dim=0)


def _chunk_arange_positions(position_ids: Any, cache_position: Any) -> bool:
    """Whether ``position_ids`` is the ``[1, n]`` copy of ``cache_position`` that 4.x's chunked prefill writes."""
    if not isinstance(position_ids, torch.Tensor) or not isinstance(cache_position, torch.Tensor):
        return False
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] != cache_position.numel():
        return False
    return torch.equal(position_ids[0].cpu(), cache_position.reshape(-1).cpu())


def pad_forward_inputs(
    call: GenerateCall, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple, dict]:
    """The arguments of ``prepare_inputs_for_generation`` in the padded layout (``first``: the prefill's)."""
    args = list(args)
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"] = args.pop(0)
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return tuple(args), kwargs
    cache_position = kwargs.get("cache_position")
    if first and call.chunked and _chunk_arange_positions(kwargs.get("position_ids"), cache_position):
        # Transformers 4.x's chunked prefill passes arange positions that ignore the caller's left padding
        # (its own bug: a padded row's prompt then sits at other positions than its decode steps). The
        # unchunked path, which the caller asked for, derives them from the mask, as the inner call does
        # when they are absent. This holds with or without a pad of ours: a prompt already at a bucket too.
        kwargs.pop("position_ids")
    if call.pad:
        if kwargs.get("attention_mask") is None:
            # Upstream drops an all-ones mask; the padded layout needs one (0 on the pad).
            seen = int(cache_position[-1]) + 1 if isinstance(cache_position, torch.Tensor) else ids.shape[1]
            kwargs["attention_mask"] = torch.ones((ids.shape[0], seen), dtype=torch.long, device=ids.device)
        for name in _SEQUENCE_INPUTS:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                kwargs[name] = _cat_columns(value, call.pad, _PAD_VALUE.get(name, call.filler))
        if isinstance(cache_position, torch.Tensor):
            shifted = cache_position + call.pad
            if first:
                prefix = torch.arange(call.pad, dtype=cache_position.dtype, device=cache_position.device)
                shifted = torch.cat([prefix, shifted])
            kwargs["cache_position"] = shifted
    if call.dummy:
        for name in _SEQUENCE_INPUTS:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                kwargs[name] = _add_rows(value, call.batch, call.dummy)
    ids = kwargs.pop("input_ids")
    return (ids, *args), kwargs


def cut_dummy_rows(outputs: Any, batch: int, dummy: int) -> Any:
    """Upstream sees ``batch`` rows of logits: the ``dummy`` rows' are dropped (on the host, after the forward)."""
    logits = getattr(outputs, "logits", None)
    if dummy and isinstance(logits, torch.Tensor) and logits.shape[0] == batch + dummy:
        # The cut is made on the host: a device-side slice would have one shape per real batch size.
        outputs.logits = logits[:, -1:].to("cpu")[:batch]
    return outputs


# --- the cache the caller gets back -----------------------------------------------------------------


def _layers(cache: Any) -> list[Any] | None:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layers:
        return None
    if not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return None
    return layers


def unpadded_cache(cache: Any, pad: int, batch: int) -> Any:
    """A copy of a returned static cache in the caller's layout: pad slots and dummy rows removed.

    Upstream may keep and reuse the cache object it built (Transformers 4.x keeps
    ``model._cache``), so the caller gets a copy; the one upstream holds keeps the
    padded layout its next call expects. A cache structure this does not know is
    returned as is, with a warning once.
    """
    if cache is None:
        return cache
    inner = getattr(cache, "self_attention_cache", cache)
    layers = _layers(inner)
    if layers is None:
        _warn_layout(type(cache).__name__)
        return cache
    rows = slice(0, batch)
    copied = []
    for layer in layers:
        new = copy.copy(layer)
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            moved = torch.zeros_like(tensor[rows])
            length = tensor.shape[-2] - pad
            moved[..., :length, :] = tensor[rows, :, pad:, :]
            setattr(new, name, moved)
        for name in ("batch_size", "max_batch_size"):
            if isinstance(getattr(layer, name, None), int):
                setattr(new, name, batch)
        seen = getattr(layer, "cumulative_length", None)
        if isinstance(seen, torch.Tensor):
            new.cumulative_length = (seen - pad).clamp_(min=0)
        elif isinstance(seen, int):
            new.cumulative_length = max(seen - pad, 0)
        copied.append(new)
    new_inner = copy.copy(inner)
    new_inner.layers = copied
    if inner is cache:
        return new_inner
    new_cache = copy.copy(cache)
    new_cache.self_attention_cache = new_inner
    return new_cache


def _warn_layout(name: str) -> None:
    logs.once(
        logger,
        ("generation.cache_layout", name),
        "accelerate_neuron: the %s returned by generate() holds the bucketed layout (pad slots first, dummy rows "
        "last): it cannot be passed back to generate() as is. Set ACCELERATE_NEURON_PROMPT_BUCKETS=off and "
        "ACCELERATE_NEURON_BATCH_BUCKETS=off for calls whose cache you reuse.",
        name,
    )


# --- encoder-decoder models: the encoder input length ---------------------------------------------


def encoder_pad(inputs_tensor: Any, generation_config: Any) -> int:
    """Columns to append to the token input of an encoder on Neuron (0: leave it as it is)."""
    if not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() != 2 or inputs_tensor.is_floating_point():
        return 0
    if returns_padded_shapes(generation_config):
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
