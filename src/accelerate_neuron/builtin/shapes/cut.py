"""Cutting a padded call's outputs and KV caches back to the caller's shapes.

A bucketed call ran on ``rows`` + dummy rows and ``length`` + pad columns; the
caller must see exactly the unpadded call's shapes. What is per row and what is
per token is read from the output's field names (Transformers' and
sentence-transformers' conventions) and ranks (:func:`sequence_dims`):

- every tensor whose first dimension is the padded batch loses the dummy rows;
- per-token outputs (``last_hidden_state``, 3-D ``logits``, ``hidden_states``,
  ``start_logits``, ``token_embeddings``, ...) lose the pad columns on
  dimension 1; attention maps (4-D ``*attentions``) on dimensions 2 and 3;
- per-row outputs (``pooler_output``, 2-D ``logits``, ``sentence_embedding``,
  ``scores``, ...) keep their other dimensions;
- a KV cache keeps the caller's rows and positions: a right-padded forward's
  dynamic cache as views (:meth:`Cut._cache`), a left-padded ``generate()``'s
  static cache as a copy with the pad slots removed (:func:`unpadded_static_cache`).

A field this cannot place (an unknown 2-D tensor as wide as the padded
length, a cache of unknown structure) raises :class:`Unplaced`: the caller
then runs the unpadded call instead. Cuts of a forward's outputs are views:
no device op, no copy. The warm-up's stand-in outputs are shaped by the same
rules (:func:`sequence_dims`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import logs

logger = logging.getLogger(__name__)

#: 2-D per-token outputs (and inputs echoed back by sentence-transformers): dimension 1 is the sequence.
PER_TOKEN_2D = frozenset(
    {
        "start_logits",
        "end_logits",
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "position_ids",
        "special_tokens_mask",
        "token_weights",
    }
)
#: Outputs with one value per row whatever their width.
PER_ROW = frozenset(
    {
        "pooler_output",
        "logits",  # 2-D: sequence classification; 3-D logits are per token (ranks decide below)
        "sentence_embedding",
        "scores",
        "text_embeds",
        "embeddings",
        "seq_relationship_logits",
        "loss",
    }
)
#: Per-row outputs even at 3 dimensions or more.
_PER_ROW_ANY_RANK = frozenset({"sentence_embedding", "pooler_output"})
_CACHES = ("past_key_values", "cache")


class Unplaced(Exception):
    """An output whose per-row / per-token layout this module cannot tell: the call runs unpadded."""


def sequence_dims(name: str, shape: tuple[int, ...] | torch.Size, length: int) -> tuple[int, ...]:
    """The dimensions of output ``name`` (of ``shape``, from a call ``length`` tokens long) that are the sequence.

    Raises :class:`Unplaced` for a 2-D output as wide as the sequence whose name does not say what it is.
    """
    rank = len(shape)
    if rank == 4 and name.endswith("attentions"):
        return (2, 3)
    if rank >= 3 and name not in _PER_ROW_ANY_RANK:
        return (1,) if shape[1] == length else ()
    if rank == 2 and name in PER_TOKEN_2D:
        return (1,)
    if rank == 2 and shape[1] == length and name not in PER_ROW:
        raise Unplaced(f"output {name or 'tensor'!r} of shape {tuple(shape)}: per row or per token?")
    return ()


@dataclass(frozen=True)
class Cut:
    """The caller's shape (``rows`` x ``length``) within the padded one (``padded_rows`` x ``padded_length``)."""

    rows: int
    length: int
    padded_rows: int
    padded_length: int

    def __call__(self, value: Any, name: str = "") -> Any:
        """``value`` (a tensor, or a container of them) in the caller's shapes."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value, name)
        if name in _CACHES and value is not None and not isinstance(value, (Mapping, list, tuple)):
            return self._cache(value)
        if isinstance(value, Mapping):
            return self._mapping(value)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self(v, name) for v in value)
        return value

    def _mapping(self, value: Mapping[str, Any]) -> Any:
        if type(value) is dict:
            return {k: self(v, k) for k, v in value.items()}
        out = copy.copy(value)  # a ModelOutput: same class, fields in place
        for key in list(value.keys()):
            out[key] = self(value[key], key)
        return out

    def _tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        if tensor.shape[0] == self.padded_rows and self.padded_rows != self.rows:
            tensor = tensor[: self.rows]
        if self.padded_length == self.length or tensor.dim() < 2:
            return tensor
        dims = sequence_dims(name, tensor.shape, self.padded_length)
        if dims == (2, 3):
            return tensor[:, :, : self.length, : self.length]
        return tensor[:, : self.length] if dims == (1,) else tensor

    def _cache(self, cache: Any) -> Any:
        """A dynamic KV cache holding the caller's rows and positions (sliced views of the padded one)."""
        layers = kv_layers(cache)
        if layers is None:
            raise Unplaced(f"a {type(cache).__name__} returned by the forward")
        for layer in layers:
            for attr in ("keys", "values"):
                tensor = getattr(layer, attr)
                if tensor.dim() != 4 or tensor.shape[-2] != self.padded_length:
                    raise Unplaced(f"a {type(cache).__name__} layer of shape {tuple(tensor.shape)}")
                setattr(layer, attr, tensor[: self.rows, :, : self.length])
            if hasattr(layer, "cumulative_length"):
                raise Unplaced(f"a sliding-window {type(cache).__name__}")
        return cache


def assemble(parts: Sequence[Any], groups: Sequence[Any], padded_rows: int, padded_length: int, name: str = "") -> Any:
    """The outputs of a call run group by group (``parts[i]`` from ``groups[i]``, each ``padded_rows`` x ``bucket``)
    as the batch's: ``padded_rows`` rows, each group's rows in their place, sequence dimensions at
    ``padded_length`` (zeros past a group's bucket: positions its rows' masks keep out). Made on the device at
    bucketed shapes only (zeros, pad, index_copy), so its eager ops are bounded by the buckets too.

    Raises :class:`Unplaced` for an output that is not per row (a scalar, a cache) or that groups disagree on.
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return _assemble_tensor(parts, groups, padded_rows, padded_length, name)
    if isinstance(first, Mapping):
        out = dict(first) if type(first) is dict else copy.copy(first)
        for key in list(first.keys()):
            out[key] = assemble([p[key] for p in parts], groups, padded_rows, padded_length, key)
        return out
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        if any(len(p) != len(first) for p in parts):
            raise Unplaced(f"output {name!r}: groups returned different numbers of items")
        return type(first)(
            assemble([p[i] for p in parts], groups, padded_rows, padded_length, name) for i in range(len(first))
        )
    if first is None or isinstance(first, (int, float, str, bool)):
        if any(p != first for p in parts):
            raise Unplaced(f"output {name!r}: groups returned different values")
        return first
    raise Unplaced(f"output {name!r}: a {type(first).__name__} cannot be put together from row groups")


def _assemble_tensor(
    parts: Sequence[torch.Tensor], groups: Sequence[Any], padded_rows: int, padded_length: int, name: str
) -> torch.Tensor:
    shape: list[int] | None = None
    placed = []
    for part, group in zip(parts, groups, strict=True):
        if part.dim() == 0 or part.shape[0] != group.padded_rows:
            raise Unplaced(f"output {name or 'tensor'!r} of shape {tuple(part.shape)} is not one row per input")
        dims = sequence_dims(name, part.shape, group.bucket) if part.dim() >= 2 else ()
        target = [padded_rows, *part.shape[1:]]
        widths = [0] * (2 * part.dim())
        for dim in dims:
            target[dim] = padded_length
            widths[2 * (part.dim() - 1 - dim) + 1] = padded_length - part.shape[dim]  # F.pad: last dim first
        if shape is not None and target != shape:
            raise Unplaced(f"output {name or 'tensor'!r}: groups returned shapes that do not line up")
        shape = target
        placed.append(torch.nn.functional.pad(part, widths) if any(widths) else part)
    assert shape is not None
    out = torch.zeros(shape, dtype=parts[0].dtype, device=parts[0].device)
    for part, group in zip(placed, groups, strict=True):
        # Dummy rows are copies of the group's first row: they write its (identical) values again.
        index = list(group.rows) + [group.rows[0]] * (group.padded_rows - len(group.rows))
        out.index_copy_(0, torch.tensor(index, dtype=torch.long).to(out.device), part)
    return out


def kv_layers(cache: Any) -> list[Any] | None:
    """The layers of a KV cache (its self-attention part) whose keys and values are tensors; None otherwise."""
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not layers:
        return None
    if not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return None
    return layers


def unpadded_static_cache(cache: Any, pad: int, rows: int) -> Any:
    """A copy of a left-padded static cache in the caller's layout: the ``pad`` slots at its start and every row
    past ``rows`` removed, its length kept (the slots freed at the end are zeros).

    Upstream may keep and reuse the cache object it built (Transformers 4.x keeps
    ``model._cache``), so the caller gets a copy; the one upstream holds keeps the
    padded layout its next call expects. A cache structure this does not know is
    returned as is, with a warning once.
    """
    if cache is None:
        return cache
    inner = getattr(cache, "self_attention_cache", cache)
    layers = kv_layers(cache)
    if layers is None:
        _warn_layout(type(cache).__name__)
        return cache
    copied = []
    for layer in layers:
        new = copy.copy(layer)
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            moved = torch.zeros_like(tensor[:rows])
            moved[..., : tensor.shape[-2] - pad, :] = tensor[:rows, :, pad:, :]
            setattr(new, name, moved)
        for name in ("batch_size", "max_batch_size"):
            if isinstance(getattr(layer, name, None), int):
                setattr(new, name, rows)
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
        ("shapes.cache_layout", name),
        "accelerate_neuron: the %s returned by generate() holds the bucketed layout (pad slots first, dummy rows "
        "last): it cannot be passed back to generate() as is. Set ACCELERATE_NEURON_PROMPT_BUCKETS=off and "
        "ACCELERATE_NEURON_BATCH_BUCKETS=off for calls whose cache you reuse.",
        name,
    )


def last_logits_of_rows(outputs: Any, rows: int, padded_rows: int) -> Any:
    """A decode step's outputs with the last position's logits of the first ``rows`` rows only (dummy rows cut).

    The cut is made on the host: a device-side slice would have one shape per real batch size.
    """
    logits = getattr(outputs, "logits", None)
    if padded_rows != rows and isinstance(logits, torch.Tensor) and logits.shape[0] == padded_rows:
        outputs.logits = logits[:, -1:].to("cpu")[:rows]
    return outputs
