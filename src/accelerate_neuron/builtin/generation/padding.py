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

from typing import TYPE_CHECKING, Any

import torch

from ... import padding as _padding
from .. import shapes

if TYPE_CHECKING:
    from .call import GenerateCall

#: Tensors of a decoder forward whose last dimension is the sequence (the columns ``pad`` extends).
_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")


def returns_padded_shapes(generation_config: Any) -> bool:
    """Whether the call returns per-position tensors (attentions, hidden states) that would show the padding."""
    return any(getattr(generation_config, k, False) for k in ("output_attentions", "output_hidden_states"))


def _add_rows(value: torch.Tensor, batch: int, dummy: int) -> torch.Tensor:
    if value.dim() == 0 or value.shape[0] != batch:
        return value  # not batched (e.g. a [1, n] position row shared by every row)
    return shapes.add_rows(value, batch + dummy)


def _chunk_arange_positions(position_ids: Any, cache_position: Any) -> bool:
    """Whether ``position_ids`` is the ``[1, n]`` copy of ``cache_position`` that 4.x's chunked prefill writes."""
    if not isinstance(position_ids, torch.Tensor) or not isinstance(cache_position, torch.Tensor):
        return False
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] != cache_position.numel():
        return False
    return torch.equal(position_ids[0].cpu(), cache_position.reshape(-1).cpu())


def count_positions(call: GenerateCall, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Count one forward in :mod:`accelerate_neuron.padding` (before it is padded): the prefill's rows x columns
    computed against the tokens the caller's mask keeps there (a mask kept on the device is not read: every
    position counts as real); a decode step's rows against the caller's rows."""
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    rows = int(ids.shape[0])
    cache_position = kwargs.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.dim() == 1:
        columns = int(cache_position.numel())
    else:
        columns = int(ids.shape[1]) if first else 1
    if not first or getattr(call.model.config, "is_encoder_decoder", False):  # an encoder's input: counted there
        _padding.add("generate_decode", rows + call.dummy, rows)
        return
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == rows and mask.device.type == "cpu":
        seen = mask[:, cache_position.cpu()] if isinstance(cache_position, torch.Tensor) else mask[:, -columns:]
        real = int(seen.sum())
    else:
        real = rows * columns
    width = columns + call.pad  # the prefill's columns, padded
    if call.groups:  # each group at its own bucket's share of them
        offset = call.prompt + call.pad - width if call.prompt else 0
        computed = sum(g.padded_rows * (g.bucket - offset) for g in call.groups)
    else:
        computed = (rows + call.dummy) * width
    _padding.add("generate_prefill", computed, real)


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
        fills = shapes.pad_values(call.filler, keys=_SEQUENCE_INPUTS)
        for name in _SEQUENCE_INPUTS:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                kwargs[name] = shapes.pad_columns(value, value.shape[-1] + call.pad, fills[name], left=True)
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


# --- encoder-decoder models: the encoder input length ---------------------------------------------


def encoder_pad(model: Any, inputs_tensor: Any, generation_config: Any) -> int:
    """Columns to append to the token input of ``model``'s encoder on Neuron (0: leave it as it is)."""
    if not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() != 2 or inputs_tensor.is_floating_point():
        return 0
    if returns_padded_shapes(generation_config):
        return 0
    rows, length = inputs_tensor.shape
    record = shapes.record_key(model)
    shapes.note(record, "prompt_buckets", length, rows)
    return shapes.resolve_policy(None, record).prompt_buckets.pad_to(length, "generate()", "prompt length") - length


def count_encoder_positions(inputs_tensor: Any, mask: Any, pad: int) -> None:
    """Count an encoder's input (the prefill of an encoder-decoder call): rows x padded length computed against
    the tokens the caller's mask keeps."""
    if not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() != 2:
        return
    rows, length = inputs_tensor.shape
    if isinstance(mask, torch.Tensor) and mask.shape == inputs_tensor.shape and mask.device.type == "cpu":
        real = int(mask.sum())
    else:
        real = rows * length
    _padding.add("generate_prefill", rows * (length + pad), real)


def pad_encoder_inputs(
    inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any], pad: int, filler: int
) -> torch.Tensor:
    """Right-pad the encoder's ids (and its attention mask, 0 on the pad) by ``pad`` columns, in ``model_kwargs``."""
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(inputs_tensor.shape, dtype=torch.long, device=inputs_tensor.device)
    length = inputs_tensor.shape[1] + pad
    model_kwargs["attention_mask"] = shapes.pad_columns(mask, length, shapes.PAD_VALUES["attention_mask"])
    return shapes.pad_columns(inputs_tensor, length, filler)
