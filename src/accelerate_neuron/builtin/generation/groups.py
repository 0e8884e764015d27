"""Rows of very different lengths in one ``generate()`` batch: the prefill runs group by group, decode together.

Upstream pads a batch to its longest prompt, and the prompt bucket pads it
further: one 1,000-token row makes seven 20-token rows compute 1,024 positions
each. Here the rows of a bucketed call are grouped by the prompt bucket of their
own extent (from their first real token to the end: a left-padded row's length),
and the prefill runs once per group, at that bucket and the group's batch bucket,
each on a static cache of its own; the keys and values are then copied into the
call's cache at the columns the batch's prefill would have written, and the
first token's logits are put back in row order. Decode steps run the whole batch
together, as before. What every row attends to is what it attended to in the
batch's prefill (its own real tokens), so the results are the batch's.

Only where this is exact and bounded: the call's prefill runs through the
compiled call (one chunk), its cache is a ``StaticCache`` of full-attention
layers, its inputs are ids, positions, token types and a 4-D mask, and grouping
computes fewer positions than the batch's prefill. Otherwise the batch prefills
as one. Each group is a compiled graph per (group batch bucket, bucket); the
copies are eager ops per (batch bucket, group batch bucket, bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..shapes.groups import Group, plan, shapes_of

__all__ = ["Group", "extents", "groupable", "plan", "prefill", "shapes_of"]

#: Inputs of the prefill a group slices (rows, and its columns); anything else batch-shaped turns grouping off.
_SEQUENCE = ("input_ids", "position_ids", "token_type_ids")
_CACHE_KEYS = ("cache", "past_key_values")
_PASSED = frozenset({"logits_to_keep", "use_cache", "return_dict", "inputs_embeds", "cache_position"})


def extents(mask: torch.Tensor, prompt: int) -> list[int]:
    """Each row's extent in a prompt of ``prompt`` columns: from its first real token (mask 1) to the end."""
    seen = mask.to("cpu") != 0
    width = seen.shape[1]
    first = torch.where(seen.any(dim=1), seen.int().argmax(dim=1), torch.full((seen.shape[0],), width))
    return [max(1, prompt - int(f)) for f in first]


def groupable(kwargs: dict[str, Any]) -> bool:
    """Whether a prefill's inputs are ones a group can slice: known tensors, a 4-D tensor mask, a static cache."""
    cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "StaticCache" or not isinstance(layers, list) or not layers:
        return False
    if any(type(layer).__name__ != "StaticLayer" for layer in layers):
        return False  # sliding or chunked layers keep a window a group's short cache would not
    if not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return False
    mask = kwargs.get("attention_mask")
    masks = mask.values() if isinstance(mask, dict) else [mask]
    if not all(isinstance(m, torch.Tensor) and m.dim() == 4 for m in masks):
        return False
    for name, value in kwargs.items():
        if name in _SEQUENCE or name in _CACHE_KEYS or name in _PASSED or name == "attention_mask":
            continue
        if isinstance(value, torch.Tensor):
            return False
    return isinstance(kwargs.get("input_ids"), torch.Tensor)


def prefill(
    call: Callable[..., Any],
    kwargs: dict[str, Any],
    groups: Sequence[Group],
    padded_width: int,
    device: torch.device,
    greedy: bool,
    config: Any,
    keep_on_device: bool = False,
) -> Any:
    """Run the prefill ``call(**kwargs)`` (host inputs, the batch's layout) group by group; the batch's outputs.

    ``padded_width``: the batch's padded prompt columns (the prefill's columns, plus the last prompt token on
    Transformers 4.x, which prefills it with the first decode step). Logits come back on the host, the last
    position's only; ``greedy``: as a one-hot row of the device-side argmax (only ids cross, as for decode steps);
    ``keep_on_device``: they stay on the device, every row of the batch (dummy rows: row 0's), for a sampler there.
    """
    cache_key = next(k for k in _CACHE_KEYS if kwargs.get(k) is not None)
    cache = kwargs[cache_key]
    ids = kwargs["input_ids"]
    rows, columns = ids.shape
    logits: torch.Tensor | None = None
    outputs = None
    for group in groups:
        offset = padded_width - group.bucket
        width = columns - offset  # this group's columns of the prefill
        index = list(group.rows) + [group.rows[0]] * (group.padded_rows - len(group.rows))
        own = type(cache)(config=config, max_cache_len=width)
        outputs = call(**_group_inputs(kwargs, cache_key, own, index, offset, width, device))
        _copy_into(cache, own, index, offset, width)
        last = outputs.logits[:, -1]
        if keep_on_device:
            part = last[: len(group.rows)]
        elif greedy:
            picked = last.argmax(dim=-1).to("cpu")[: len(group.rows)]
            part = torch.zeros((len(group.rows), last.shape[-1]), dtype=torch.float32)
            part.scatter_(-1, picked.view(-1, 1), 1.0)
        else:
            part = last.to("cpu")[: len(group.rows)]
        if logits is None:
            logits = torch.zeros((rows, 1, part.shape[-1]), dtype=part.dtype, device=part.device)
        logits[torch.tensor(group.rows).to(part.device), 0] = part
    assert outputs is not None and logits is not None
    filled = {r for g in groups for r in g.rows}
    for row in range(rows):  # the batch's dummy rows (copies of row 0): their logits are cut later
        if row not in filled:
            logits[row] = logits[0]
    _set_lengths(cache, columns)
    outputs.logits = logits
    for key in _CACHE_KEYS:
        if key in outputs.keys():
            outputs[key] = cache
    return outputs


def _group_inputs(
    kwargs: dict[str, Any], cache_key: str, cache: Any, index: list[int], offset: int, width: int, device: torch.device
) -> dict[str, Any]:
    rows = kwargs["input_ids"].shape[0]
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name == cache_key:
            out[name] = cache
        elif name in _SEQUENCE and isinstance(value, torch.Tensor):
            picked = value[..., index, :] if value.shape[-2] == rows else value  # a [1, n] position row is shared
            out[name] = picked[..., offset:].contiguous().to(device)
        elif name == "attention_mask":
            out[name] = (
                {k: _group_mask(m, index, offset, width, device) for k, m in value.items()}
                if isinstance(value, dict)
                else _group_mask(value, index, offset, width, device)
            )
        elif name == "cache_position" and isinstance(value, torch.Tensor):
            out[name] = torch.arange(width, dtype=value.dtype).to(device)
        else:
            out[name] = value
    return out


def _group_mask(mask: torch.Tensor, index: list[int], offset: int, width: int, device: torch.device) -> torch.Tensor:
    """The batch's 4-D mask for a group: its rows, its query columns, and the cache slots it writes (its own cache's
    slot ``j`` is the batch cache's slot ``offset + j``)."""
    picked = mask[index] if mask.shape[0] > 1 else mask
    return picked[:, :, offset : offset + width, offset : offset + width].contiguous().to(device)


def _copy_into(cache: Any, own: Any, index: list[int], offset: int, width: int) -> None:
    """The group's keys and values into the batch cache's rows, at the columns the batch's prefill writes (each
    layer's on its own core: a model split over cores keeps its layers' caches where the layers are)."""
    rows = torch.tensor(index, dtype=torch.long)
    on: dict[torch.device, torch.Tensor] = {}
    for layer, mine in zip(cache.layers, own.layers, strict=True):
        for name in ("keys", "values"):
            target = getattr(layer, name)
            here = on.setdefault(target.device, rows.to(target.device))
            target[:, :, offset : offset + width].index_copy_(0, here, getattr(mine, name)[:, :, :width])


def _set_lengths(cache: Any, columns: int) -> None:
    """What the batch's prefill leaves in each layer's fill count (Transformers 5's static layers keep one)."""
    for layer in cache.layers:
        seen = getattr(layer, "cumulative_length", None)
        if isinstance(seen, torch.Tensor):
            seen.fill_(columns)
        elif isinstance(seen, int):
            layer.cumulative_length = columns
