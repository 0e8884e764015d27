"""What padding is filled with: one value per input name, one choice of pad token id, and the padding itself.

Every padded position is invisible to the caller: the attention mask is 0 there
(no real token attends to it), labels are -100 (no loss counts it), and every
output is cut back (:mod:`.cut`). So a pad's value is never read; it only has to
be *valid*, whichever side it is on and whatever the model does with it:

- ``input_ids``: a token id inside the vocabulary (:func:`pad_id`);
- ``position_ids``: 0, never the 1 upstream writes for its own left pads. A pad
  must index every position table (0 always does), and where a model reads
  sequence boundaries from the positions (a padding-free batch without a mask:
  Transformers' ``find_packed_sequence_indices``, flash attention's varlen path)
  a 0 starts a sequence of its own, so a pad never joins the real sequence
  before it. A 1 after a row whose last sequence is one token long (position 0)
  would continue that sequence;
- masks that say "counts" (``attention_mask``, TRL's ``completion_mask`` /
  ``assistant_masks``): 0; ``special_tokens_mask``: 1 (a pad is special);
- ``token_type_ids``: the tokenizer's ``pad_token_type_id`` (0 without one).

A ``decoder_`` key pads as its unprefixed name (``decoder_input_ids`` with the
pad token, ``decoder_attention_mask`` with 0, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: The pad token id (:func:`pad_id`) and the tokenizer's pad token type id stand for themselves in :data:`PAD_VALUES`.
PAD_ID = "pad"
PAD_TYPE = "pad_type"

#: The value each sequence-shaped input is padded with (see the module's docstring for why each).
PAD_VALUES: Mapping[str, int | str] = {
    "input_ids": PAD_ID,
    "attention_mask": 0,
    "token_type_ids": PAD_TYPE,
    "position_ids": 0,
    "labels": -100,
    "special_tokens_mask": 1,
    # TRL: which tokens count in a completion-only / assistant-only loss (0: not counted).
    "completion_mask": 0,
    "assistant_masks": 0,
}
_DECODER = "decoder_"


def known_key(key: str) -> str | None:
    """The :data:`PAD_VALUES` entry that pads ``key`` (``decoder_x`` pads as ``x``), or None."""
    if key in PAD_VALUES:
        return key
    if key.startswith(_DECODER) and key[len(_DECODER) :] in PAD_VALUES:
        return key[len(_DECODER) :]
    return None


def _first_id(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        value = value.flatten()[0].item() if value.numel() else None
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pad_id(*sources: Any, vocab: int | None = None, names: Iterable[str] = ("pad_token_id",)) -> int:
    """The token id padding is filled with: the first of ``names`` (``pad_token_id``; a caller may add
    ``eos_token_id``, ...) that one of ``sources`` (a tokenizer, a collator, a model or generation config, or an
    id itself) holds as a valid id (``>= 0``, below ``vocab`` when known), tried name by name; else 0.

    Its value is never attended to nor counted; it must only index the embedding table.
    """
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    for name in names:
        for source in sources:
            value = _first_id(source if isinstance(source, int) else getattr(source, name, None))
            if value is not None and value >= 0 and (vocab is None or value < vocab):
                return value
    return 0


def pad_values(pad_token: int, pad_type: int = 0, keys: Iterable[str] = ()) -> dict[str, int]:
    """Each name of :data:`PAD_VALUES` (and its ``decoder_`` twin) with its value, the pad token's and the pad
    token type's filled in; ``keys``: only those names (their ``decoder_`` twins included)."""
    wanted = set(keys)
    values: dict[str, int] = {}
    for name, value in PAD_VALUES.items():
        if wanted and name not in wanted:
            continue
        filled = pad_token if value == PAD_ID else pad_type if value == PAD_TYPE else value
        assert isinstance(filled, int)
        values[name] = values[_DECODER + name] = filled
    return values


def pad_columns(value: torch.Tensor, length: int, fill: int | float, left: bool = False, dim: int = -1) -> torch.Tensor:
    """``value`` grown to ``length`` along ``dim`` with ``fill``, on the right (or the ``left``); as is if it is
    that long already."""
    dim = dim % value.dim()
    extra = length - value.shape[dim]
    if extra <= 0:
        return value
    shape = list(value.shape)
    shape[dim] = extra
    pad = torch.full(shape, fill, dtype=value.dtype, device=value.device)
    return torch.cat([pad, value] if left else [value, pad], dim=dim)


def add_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    """``value`` grown to ``rows`` rows with copies of row 0 (no added row is all padding, so none is fully
    masked); as is if it has that many."""
    extra = rows - value.shape[0]
    if extra <= 0:
        return value
    return torch.cat([value, value[:1].expand(extra, *value.shape[1:])], dim=0)
