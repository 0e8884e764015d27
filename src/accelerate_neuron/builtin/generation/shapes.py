"""Which prompt lengths and batch sizes ``generate()`` compiles for on Neuron: the shape policy.

Every new input shape of a compiled graph is a new Neuron compile, so the
prefill (prompt length x batch) and decode (cache length x batch) graphs are
only ever compiled for a few bucketed shapes. The buckets are the
``prompt_buckets`` and ``batch_buckets`` settings (:mod:`accelerate_neuron.settings`:
environment, config file, the ``neuron_generation_shape_policy`` hook, default):

- prompt lengths: ``pow2`` (default: 32, 64, ... up to ``max_position_embeddings``),
  ``off``, or ascending lengths ``128,512,2048``;
- batch sizes: ``pow2`` (default: 1, 2, 4, ... 256), ``off``, or ascending sizes ``1,4,16``.

A prompt (or batch) larger than the largest bucket keeps its own shape, with a
warning once: never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ... import logs, settings

logger = logging.getLogger(__name__)

PROMPT_BUCKETS_ENV = settings.env_name("prompt_buckets")
BATCH_BUCKETS_ENV = settings.env_name("batch_buckets")
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


def max_positions(model: Any) -> int | None:
    """The decoder's context length (``max_position_embeddings``), or None if the config does not say."""
    try:
        config = model.config.get_text_config(decoder=True)
    except Exception:
        config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def short(values: tuple[int, ...]) -> str:
    """Buckets for a log line: ``1, 2, 4, ... 256``."""
    if not values:
        return "off"
    if len(values) <= 5:
        return ", ".join(map(str, values))
    return f"{values[0]}, {values[1]}, {values[2]}, ... {values[-1]}"


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
    return {"prompt_buckets": settings.POW2, "batch_buckets": settings.POW2}


def resolve_policy(max_position_embeddings: int | None) -> ShapePolicy:
    """The policy in force: each bucket setting from the environment, a config file, the hook, or the default."""
    from ...plugins import call_hook

    answer = call_hook("neuron_generation_shape_policy", max_position_embeddings=max_position_embeddings)
    if answer is not None and (not isinstance(answer, dict) or set(answer) - set(_KEYS)):
        raise ValueError(
            f"neuron_generation_shape_policy returned {answer!r}: expected a dict with keys among {list(_KEYS)}"
        )
    pow2: dict[str, Callable[[], tuple[int, ...]]] = {
        "prompt_buckets": lambda: pow2_prompt_buckets(max_position_embeddings),
        "batch_buckets": pow2_batch_buckets,
    }
    chosen = {}
    for key in _KEYS:
        spec = settings.resolve(key, hook=lambda k=key: (answer or {}).get(k)).value
        chosen[key] = pow2[key]() if spec == settings.POW2 else spec
    return ShapePolicy(chosen["prompt_buckets"], chosen["batch_buckets"])


def warn_beyond_largest(kind: str, value: int, buckets: Sequence[int], env: str) -> None:
    """Once per (kind, value): this prompt length / batch size has no bucket and compiles at its own shape."""
    logs.once(
        logger,
        ("generation.beyond_largest", kind, value),
        "accelerate_neuron: generate() got a %s of %d, more than the largest bucket (%d); it runs unpadded and "
        "compiles its own graphs. Add a larger bucket with %s (now %s).",
        kind,
        value,
        buckets[-1],
        env,
        ",".join(map(str, buckets)),
    )
