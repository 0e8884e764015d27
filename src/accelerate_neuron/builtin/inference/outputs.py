"""Cutting a bucketed forward's outputs back to the caller's shapes.

The forward ran on ``rows`` + dummy rows and ``length`` + pad columns; the
caller must see exactly the unpadded call's shapes. What is per row and what is
per token is read from the output's field names (Transformers' and
sentence-transformers' conventions) and ranks:

- every tensor whose first dimension is the padded batch loses the dummy rows;
- per-token outputs (``last_hidden_state``, 3-D ``logits``, ``hidden_states``,
  ``start_logits``, ``token_embeddings``, ...) lose the pad columns on
  dimension 1; attention maps (4-D ``*attentions``) on dimensions 2 and 3;
- per-row outputs (``pooler_output``, 2-D ``logits``, ``sentence_embedding``,
  ``scores``, ...) keep their other dimensions;
- a KV cache the forward returned keeps the caller's rows and positions.

A field this cannot place (an unknown 2-D tensor as wide as the padded
length, a cache of unknown structure) raises :class:`Unplaced`: the caller
then runs the unpadded forward instead. Cuts are views of the padded outputs:
no device op, no copy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

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
_CACHES = ("past_key_values", "cache")


class Unplaced(Exception):
    """An output whose per-row / per-token layout this module cannot tell: the call runs unpadded."""


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
        if tensor.dim() == 4 and name.endswith("attentions"):
            return tensor[:, :, : self.length, : self.length]
        if tensor.dim() >= 3 and name not in ("sentence_embedding", "pooler_output"):
            return tensor[:, : self.length] if tensor.shape[1] == self.padded_length else tensor
        if name in PER_TOKEN_2D:
            return tensor[:, : self.length]
        if tensor.dim() == 2 and tensor.shape[1] == self.padded_length and name not in PER_ROW:
            raise Unplaced(f"output {name or 'tensor'!r} of shape {tuple(tensor.shape)}: per row or per token?")
        return tensor

    def _cache(self, cache: Any) -> Any:
        """A dynamic KV cache holding the caller's rows and positions (sliced views of the padded one)."""
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list) or not all(
            isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers
        ):
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
