"""Which prompt lengths and batch sizes ``generate()`` compiles for on Neuron: the shape policy.

Every new input shape of a compiled graph is a new Neuron compile, so the
prefill (prompt length x batch) and decode (cache length x batch) graphs are
only ever compiled for a few bucketed shapes. The policy is the
``neuron_generation_shape_policy`` hook's answer, overridden by the
environment:

- ``ACCELERATE_NEURON_PROMPT_BUCKETS``: ``pow2`` (default: 32, 64, ... up to
  ``max_position_embeddings``), ``off``, or ascending lengths ``128,512,2048``;
- ``ACCELERATE_NEURON_BATCH_BUCKETS``: ``pow2`` (default: 1, 2, 4, ... 256),
  ``off``, or ascending sizes ``1,4,16``.

A prompt (or batch) larger than the largest bucket keeps its own shape, with a
warning once: never an error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("accelerate_neuron")

PROMPT_BUCKETS_ENV = "ACCELERATE_NEURON_PROMPT_BUCKETS"
BATCH_BUCKETS_ENV = "ACCELERATE_NEURON_BATCH_BUCKETS"
#: Shortest prompt bucket: shorter prefills cost next to nothing, and would each be a graph.
MIN_PROMPT_BUCKET = 32
#: Without a known context length, prompt buckets stop here (a longer prompt runs at its own length).
DEFAULT_MAX_PROMPT = 8192
#: Largest default batch bucket; larger batches run at their own size.
MAX_BATCH_BUCKET = 256
_KEYS = ("prompt_buckets", "batch_buckets")


@dataclass(frozen=True)
class ShapePolicy:
    """Ascending prompt-length and batch-size buckets; an empty tuple turns that bucketing off."""

    prompt_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]

    def prompt_bucket(self, length: int) -> int | None:
        """The prompt bucket for ``length`` tokens, or None when none holds it (or bucketing is off)."""
        return _smallest_at_least(self.prompt_buckets, length)

    def batch_bucket(self, size: int) -> int | None:
        """The batch bucket for ``size`` rows, or None when none holds it (or bucketing is off)."""
        return _smallest_at_least(self.batch_buckets, size)


def _smallest_at_least(buckets: Sequence[int], value: int) -> int | None:
    return next((b for b in buckets if b >= value), None)


def pow2_prompt_buckets(max_position_embeddings: int | None) -> tuple[int, ...]:
    """Powers of two from :data:`MIN_PROMPT_BUCKET` up to the context length (which is one if it is not)."""
    limit = max_position_embeddings or DEFAULT_MAX_PROMPT
    buckets = []
    length = MIN_PROMPT_BUCKET
    while length < limit:
        buckets.append(length)
        length *= 2
    buckets.append(max(limit, MIN_PROMPT_BUCKET) if max_position_embeddings else length)
    return tuple(buckets)


def pow2_batch_buckets() -> tuple[int, ...]:
    return tuple(1 << i for i in range(MAX_BATCH_BUCKET.bit_length()))


def default_policy(max_position_embeddings: int | None) -> dict[str, Any]:
    """The built-in answer of ``neuron_generation_shape_policy``."""
    return {
        "prompt_buckets": pow2_prompt_buckets(max_position_embeddings),
        "batch_buckets": pow2_batch_buckets(),
    }


def parse_buckets(raw: str | None, env: str, what: str, example: str = "32,128,512") -> str | tuple[int, ...] | None:
    """``None`` (unset), ``"pow2"``, ``()`` (off) or an ascending tuple, from ``env``'s value ``raw``."""
    text = (raw or "").strip().lower()
    if text == "":
        return None
    if text == "pow2":
        return "pow2"
    if text in ("off", "0", "none", "no"):
        return ()
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values) or list(values) != sorted(set(values)):
        raise ValueError(
            f"invalid {env}={raw!r}: expected 'pow2' (default), 'off', or ascending positive {what} separated by "
            f"commas, e.g. '{example}'"
        )
    return values


def _checked(value: Any, key: str) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"neuron_generation_shape_policy returned {key}={value!r}: expected a list of ints")
    values = tuple(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values) or list(values) != sorted(
        set(values)
    ):
        raise ValueError(
            f"neuron_generation_shape_policy returned {key}={value!r}: expected ascending positive ints "
            "(an empty list turns that bucketing off)"
        )
    return values


def resolve_policy(max_position_embeddings: int | None) -> ShapePolicy:
    """The policy in force: the hook's answer (built-in: powers of two), then the environment's overrides."""
    from ...plugins import call_hook

    answer = call_hook("neuron_generation_shape_policy", max_position_embeddings=max_position_embeddings)
    merged = default_policy(max_position_embeddings)
    if answer is not None:
        if not isinstance(answer, dict) or set(answer) - set(_KEYS):
            raise ValueError(
                f"neuron_generation_shape_policy returned {answer!r}: expected a dict with keys among {list(_KEYS)}"
            )
        merged.update({k: _checked(v, k) for k, v in answer.items() if v is not None})
    for key, env, what, pow2 in (
        ("prompt_buckets", PROMPT_BUCKETS_ENV, "prompt lengths", lambda: pow2_prompt_buckets(max_position_embeddings)),
        ("batch_buckets", BATCH_BUCKETS_ENV, "batch sizes", pow2_batch_buckets),
    ):
        override = parse_buckets(os.environ.get(env), env, what)
        if override == "pow2":
            merged[key] = pow2()
        elif override is not None:
            merged[key] = override
    return ShapePolicy(tuple(merged["prompt_buckets"]), tuple(merged["batch_buckets"]))


_warned_beyond: set[tuple[str, int]] = set()


def warn_beyond_largest(kind: str, value: int, buckets: Sequence[int], env: str) -> None:
    """Once per (kind, value): this prompt length / batch size has no bucket and compiles at its own shape."""
    key = (kind, value)
    if key in _warned_beyond:
        return
    _warned_beyond.add(key)
    logger.warning(
        "accelerate_neuron: generate() got a %s of %d, more than the largest bucket (%d); it runs unpadded and "
        "compiles its own graphs. Add a larger bucket with %s (now %s).",
        kind,
        value,
        buckets[-1],
        env,
        ",".join(map(str, buckets)),
    )
