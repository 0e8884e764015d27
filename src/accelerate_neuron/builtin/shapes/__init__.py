"""The shape layer every capability uses: which sizes a call is padded to, with what, and how it is cut back.

Every new input shape of a compiled graph is a new Neuron compile, so generate(),
bucketed inference calls, training batches, continuous batching's steps, the
warm-up and compiled regions all pad the dimensions that vary up to a few
buckets, and give the caller exactly the unpadded call's results and shapes.
The idea is written once, here:

- :mod:`.buckets`: the bucket set type (smallest bucket holding a size, power-of-
  two lists, the cap at what the model addresses, the one message for a size
  beyond the largest);
- :mod:`.policy`: which buckets are in force (each bucket setting through
  ``settings``' one precedence; the model's position limit);
- :mod:`.pads`: what padding is filled with (one value per input name, one pad
  token id) and the padding itself;
- :mod:`.cut`: outputs and KV caches cut back to the caller's shapes;
- :mod:`.room`: room in Dynamo's recompile limit for the bucketed graphs;
- :mod:`.record` and :mod:`.fit`: the sizes a job's calls see, recorded beside
  its compiled graphs, and the buckets fitted to them (a bucket setting's ``fit``).

This package is a shared layer, not a plugin: any built-in plugin may import it,
and it imports none of them (``tests/test_layout.py``).
"""

from __future__ import annotations

from .buckets import MAX_BUCKET, Buckets, pow2, round_up_pow2, round_up_pow2_half
from .cut import Cut, Unplaced, kv_layers, last_logits_of_rows, sequence_dims, unpadded_static_cache
from .pads import PAD_VALUES, add_rows, known_key, pad_columns, pad_id, pad_values
from .policy import (
    BATCH_BUCKETS_ENV,
    PROMPT_BUCKETS_ENV,
    ShapePolicy,
    buckets,
    from_spec,
    hook_answer,
    max_positions,
    pow2_batch_buckets,
    pow2_prompt_buckets,
    resolve_policy,
)
from .record import note, record_key
from .room import make_room_for_buckets

__all__ = [
    "BATCH_BUCKETS_ENV",
    "MAX_BUCKET",
    "PAD_VALUES",
    "PROMPT_BUCKETS_ENV",
    "Buckets",
    "Cut",
    "ShapePolicy",
    "Unplaced",
    "add_rows",
    "buckets",
    "from_spec",
    "hook_answer",
    "known_key",
    "kv_layers",
    "last_logits_of_rows",
    "make_room_for_buckets",
    "max_positions",
    "note",
    "pad_columns",
    "pad_id",
    "pad_values",
    "pow2",
    "pow2_batch_buckets",
    "pow2_prompt_buckets",
    "record_key",
    "resolve_policy",
    "round_up_pow2",
    "round_up_pow2_half",
    "sequence_dims",
    "unpadded_static_cache",
]
