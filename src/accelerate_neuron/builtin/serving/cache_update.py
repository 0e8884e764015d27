"""The paged KV cache's update on Neuron: one eager shape per step bucket, whatever the number of layers.

Upstream runs the update outside the compiled graph (``torch.compiler.disable``:
views of the cache tensor do not trace well), so on Neuron its ``index_copy_``
/ ``index_select`` run as eager ops, compiled once per shape. Upstream indexes a
per-layer view of the cache that starts at the layer's first page and runs to
the end of the tensor, so every layer's view has another length, hence other
eager shapes: a 32-layer model compiles each op 64 times per step bucket. Here
every layer indexes the whole (flattened) cache with its indices shifted by the
layer's offset: the same rows are written and read, and a step bucket costs the
same few eager shapes for every layer.

Upstream's ``PagedAttentionCache.update`` is wrapped in ``torch.compiler.disable``:
each layer's call ends the graph, so a step is ``2 x layers + 1`` compiled pieces
with a device->host->device hop between each. On Neuron the shifted-row update
above traces (one view of the cache tensor, made inside the graph), so while
Dynamo traces a step on Neuron the update runs inline (:func:`wrap_paged_update`)
and the step is one graph per (query, KV) bucket. The layouts are read once,
eagerly, before the first step (:func:`prepare`): a traced step only reads
integers from them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ... import device as neuron_device

_OFFSETS = "_accelerate_neuron_layer_offsets"


def _layer_offsets(allocator: Any) -> tuple[torch.Tensor, dict[int, tuple[int, int]]] | None:
    """(whole cache as token rows, layer -> (key offset, value offset)); None for a cache it does not know."""
    known = allocator.__dict__.get(_OFFSETS)
    if known is not None:
        return known
    cache = getattr(allocator, "cache_tensor", None)
    views = getattr(allocator, "_kv_token_views", None)
    if not isinstance(cache, torch.Tensor) or not isinstance(views, dict) or cache.dim() != 4:
        return None
    rows = cache.view(-1, *cache.shape[2:])  # upstream's own flattened view: [tokens * 2, heads, head_dim]
    offsets = {}
    for layer, (keys, values) in views.items():
        start_k = (keys.storage_offset() - rows.storage_offset()) // rows.stride(0)
        start_v = (values.storage_offset() - rows.storage_offset()) // rows.stride(0)
        if keys.shape[1:] != rows.shape[1:] or keys.shape[0] != rows.shape[0] - start_k:
            return None  # not the layout this rewrite knows: leave upstream's update
        offsets[layer] = (start_k, start_v)
    allocator.__dict__[_OFFSETS] = (rows, offsets)
    return rows, offsets


def prepare(cache: Any) -> None:
    """Read every allocator's layout eagerly (a traced step must not inspect storage offsets)."""
    for allocator in getattr(cache, "cache_allocators", {}).values():
        if _OFFSETS not in allocator.__dict__:
            _layer_offsets(allocator)


def wrap_paged_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """``PagedAttentionCache.update`` traced inline on Neuron (upstream: ``torch.compiler.disable``, a graph break
    per layer)."""

    def update(
        self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        traced = torch.compiler.is_compiling() and key_states.device.type == "neuron"
        if not traced or kwargs.get("block_table") is not None:
            return original(self, key_states, value_states, layer_idx, kwargs)
        allocator = self.layer_to_allocator[layer_idx]
        layout = allocator.__dict__.get(_OFFSETS)
        if layout is None or layer_idx not in layout[1]:
            return original(self, key_states, value_states, layer_idx, kwargs)  # the break stays: simulate names it
        start_k, start_v = layout[1][layer_idx]
        # Upstream's bookkeeping, as its update does it (the kwargs are updated in place).
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
        keys, values = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
        cache = allocator.cache_tensor
        rows = cache.view(-1, *cache.shape[2:])  # a view made in the graph: the cache tensor is its one input
        rows.index_copy_(0, write_index + start_k, keys)
        rows.index_copy_(0, write_index + start_v, values)
        if read_index.numel() != 0:
            keys, values = rows.index_select(0, read_index + start_k), rows.index_select(0, read_index + start_v)
        return tuple(x.transpose(0, 1).unsqueeze(0) for x in (keys, values))  # type: ignore[return-value]

    return update


def wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """``FullAttentionCacheAllocator.update`` on Neuron: the whole cache indexed at shifted rows."""

    @functools.wraps(original)
    def update(
        self: Any,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        read_index: torch.Tensor,
        write_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = _layer_offsets(self) if neuron_device.is_neuron(key_states.device) else None
        if layout is None or layer_idx not in layout[1]:
            return original(self, key_states, value_states, layer_idx, read_index, write_index)
        rows, offsets = layout
        start_k, start_v = offsets[layer_idx]
        rows.index_copy_(0, write_index + start_k, key_states)
        rows.index_copy_(0, write_index + start_v, value_states)
        if read_index.numel() == 0:
            return key_states, value_states
        return rows.index_select(0, read_index + start_k), rows.index_select(0, read_index + start_v)

    return update
