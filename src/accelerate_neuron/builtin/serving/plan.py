"""What continuous batching pads to on Neuron, and how large its KV cache is: the serving plan.

Transformers' continuous batching packs every request of a step into one
``[1, tokens]`` row and reads the KV cache through one index of all their past
tokens, so a step's shape is (query tokens, KV tokens read), both changing at
every step. On Neuron each new shape is a compile, so a step is padded to a
bucket of each, and the compiled step only ever sees the bucket grid:

- query tokens: the ``serving_token_buckets`` setting (``pow2``: 32, 64, ...
  512). The largest is the step's token budget (``max_batch_tokens``): the
  scheduler splits a longer prompt across steps, as upstream does;
- KV tokens read: ``serving_kv_buckets`` (``pow2``: 512, 1024, ... up to the
  cache's capacity, always the last bucket);
- the cache's capacity: ``serving_kv_cache_tokens`` (16384 tokens). A request
  that cannot fit (prompt + ``max_new_tokens``) is refused with an error
  instead of waiting forever for room.

The values come from the environment, a config file, the
``neuron_serving_shape_policy`` hook or the defaults (:mod:`accelerate_neuron.settings`);
what the caller set in its ``ContinuousBatchingConfig`` wins over all of them.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ... import device as neuron_device
from ... import logs, settings
from ...sizes import format_size

logger = logging.getLogger(__name__)

TOKEN_BUCKETS_ENV = settings.env_name("serving_token_buckets")
KV_BUCKETS_ENV = settings.env_name("serving_kv_buckets")
KV_CACHE_ENV = settings.env_name("serving_kv_cache_tokens")
#: Smallest ``pow2`` query bucket: a decode step of a few requests costs next to nothing at 32 tokens.
MIN_TOKEN_BUCKET = 32
#: Largest ``pow2`` query bucket, the default token budget of a step (512 rows of activations).
MAX_TOKEN_BUCKET = 512
#: Smallest ``pow2`` KV bucket.
MIN_KV_BUCKET = 512
#: Requests one step may hold (the compiled step's logits rows): upstream's default (1024) costs a vocabulary-
#: sized fp32 row each, and its hint-based default changes with every generate_batch call, hence every graph.
MAX_REQUESTS = 256
#: Share of a core's free memory the KV cache may take by default; the rest is for compiled graphs' scratch.
MEMORY_SHARE = 0.9
#: Where the plan rides on the resolved ContinuousBatchingConfig (upstream deep-copies it: the plan goes along).
PLAN_ATTR = "_accelerate_neuron_serving_plan"
_KEYS = ("token_buckets", "kv_buckets", "kv_cache_tokens")
CB = "transformers.generation.continuous_batching"


def without_step_padding(_original: Any = None) -> str | None:
    """Feature probe of the patches: the release's continuous batching pads and compiles its step (``model_runner``)."""
    if importlib.util.find_spec(f"{CB}.model_runner") is None:
        return (
            f"this release's continuous batching has no {CB}.model_runner (no step padding or compile configs, "
            "e.g. 4.57): left as upstream has it"
        )
    return None


@dataclass(frozen=True)
class ServingPlan:
    """The buckets of continuous batching on Neuron, and which dimensions the caller pads upstream's way."""

    token_buckets: tuple[int, ...]  # ascending; the last is the step's token budget (empty: buckets off)
    kv_buckets: tuple[int, ...]  # ascending; the cache's capacity is added as the last at run time
    kv_cache_tokens: int
    compiled: bool = True  # steps padded and compiled (False: buckets off, upstream's eager path)
    queries_by_interval: bool = False  # the caller set q_padding_interval_size: upstream pads queries
    kv_by_interval: bool = False  # the caller set kv_padding_interval_size: upstream pads KV reads

    def token_bucket(self, tokens: int, budget: int) -> int:
        """Query tokens a step of ``tokens`` is padded to (``budget``: the step's largest, always a bucket)."""
        return _smallest_at_least([b for b in self.token_buckets if b < budget] + [budget], tokens)

    def kv_grid(self, capacity: int) -> tuple[int, ...]:
        """The KV buckets for a cache of ``capacity`` tokens (which is the last)."""
        return (*(b for b in self.kv_buckets if b < capacity), capacity)

    def kv_bucket(self, tokens: int, capacity: int) -> int:
        """KV tokens a step reading ``tokens`` is padded to (upstream reads one interval even when 0)."""
        return _smallest_at_least(self.kv_grid(capacity), max(tokens, 1))

    def grid(self, budget: int, capacity: int) -> list[tuple[int, int]]:
        """Every (query tokens, KV tokens) shape a step can have: what a warm-up compiles."""
        tokens = [b for b in self.token_buckets if b < budget] + [budget]
        return [(q, kv) for q in tokens for kv in self.kv_grid(capacity)]


def _smallest_at_least(buckets: Sequence[int], value: int) -> int:
    return next((b for b in buckets if b >= value), buckets[-1])


def pow2(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from ``low`` up to ``high`` (``high`` is the last, a power of two or not)."""
    values, value = [], low
    while value < high:
        values.append(value)
        value *= 2
    return (*values, high)


def kv_bytes_per_token(config: Any) -> int:
    """Bytes one token takes in the paged KV cache: keys and values of every layer, in the model's dtype."""
    import torch

    try:  # the cache's own arithmetic, where the release has it
        from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

        heads, head_dim = find_num_key_value_heads(config), find_head_dim(config)
    except ImportError:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = getattr(config, "dtype", None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else torch.float32.itemsize
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    return 2 * layers * heads * head_dim * itemsize


def default_policy() -> dict[str, Any]:
    """The built-in answer of ``neuron_serving_shape_policy``."""
    return {"token_buckets": settings.POW2, "kv_buckets": settings.POW2}


def resolve(config: Any, device: Any) -> ServingPlan:
    """The plan in force for a model of ``config`` on Neuron ``device`` (buckets off: not ``compiled``)."""
    from ...plugins import call_hook

    per_token = kv_bytes_per_token(config)
    positions = getattr(config, "max_position_embeddings", None)
    answer = call_hook("neuron_serving_shape_policy", max_position_embeddings=positions, kv_bytes_per_token=per_token)
    if answer is not None and (not isinstance(answer, dict) or set(answer) - set(_KEYS)):
        raise ValueError(f"neuron_serving_shape_policy returned {answer!r}: expected a dict with keys among {_KEYS}")
    chosen = {key: settings.resolve(f"serving_{key}", hook=lambda k=key: (answer or {}).get(k)) for key in _KEYS}
    tokens, kv = chosen["token_buckets"].value, chosen["kv_buckets"].value
    cache_tokens = _fitting_cache_tokens(chosen["kv_cache_tokens"], per_token, device)
    if not tokens or not kv:
        return ServingPlan((), (), cache_tokens, compiled=False)
    return ServingPlan(
        token_buckets=pow2(MIN_TOKEN_BUCKET, MAX_TOKEN_BUCKET) if tokens == settings.POW2 else tokens,
        kv_buckets=pow2(MIN_KV_BUCKET, cache_tokens) if kv == settings.POW2 else kv,
        kv_cache_tokens=cache_tokens,
    )


def _fitting_cache_tokens(chosen: settings.Value, per_token: int, device: Any) -> int:
    """The cache's capacity: the chosen one if it fits the core; a user's choice that does not is an error, a
    plugin's or the default shrinks to fit."""
    tokens = int(chosen.value)
    index = neuron_device.core_index(device)
    if index is None:
        return tokens
    free = neuron_device.core_memory(index).free
    room = int(free * MEMORY_SHARE) // per_token
    if tokens <= room:
        return tokens
    need = format_size(tokens * per_token)
    if chosen.explicit:
        raise ValueError(
            f"{KV_CACHE_ENV}={tokens} ({chosen.describe()}) needs {need} of KV cache on neuron:{index}, which has "
            f"{format_size(free)} free: at most {room} tokens fit ({int(MEMORY_SHARE * 100)}% of it). Set a smaller "
            "value."
        )
    if room <= 0:
        raise ValueError(
            f"no room for a KV cache on neuron:{index} ({format_size(free)} free, {per_token} bytes a token): the "
            "model fills the core. Load it across more cores, or in a smaller dtype."
        )
    logs.once(
        logger,
        ("serving.cache_shrunk", index, room),
        "accelerate_neuron: continuous batching's KV cache of %d tokens (%s) does not fit neuron:%d (%s free): it "
        "holds %d tokens instead. Set %s to choose.",
        tokens,
        need,
        index,
        format_size(free),
        room,
        KV_CACHE_ENV,
    )
    return room


def apply(plan: ServingPlan, cb_config: Any) -> Any:
    """A copy of the caller's ``ContinuousBatchingConfig`` with Neuron's choices where the caller made none.

    The caller's own values win: ``num_blocks`` (the cache's size, set by the plan even with buckets off),
    ``max_batch_tokens`` (the token budget; buckets above it are dropped), ``max_requests_per_batch``,
    ``varlen_compile_config``, and the padding intervals (that dimension is then padded upstream's way).
    """
    from transformers.generation.configuration_utils import CompileConfig

    from ..generation.cache import default_compile_config

    chosen = copy.deepcopy(cb_config)
    if chosen.num_blocks is None:
        # Upstream sizes the cache from the memory of CUDA, XPU, MPS or else the host: on Neuron, the host's.
        chosen.num_blocks = max(1, math.ceil(plan.kv_cache_tokens / chosen.page_size))
    if not plan.compiled:
        return chosen
    if chosen.max_batch_tokens is None:
        chosen.max_batch_tokens = plan.token_buckets[-1]
    if chosen.max_requests_per_batch is None:
        chosen.max_requests_per_batch = min(MAX_REQUESTS, chosen.max_batch_tokens)
    if chosen.varlen_compile_config is None:
        compile_config = default_compile_config("serving")
        if isinstance(compile_config, CompileConfig):
            chosen.varlen_compile_config = compile_config
    return chosen


def with_intervals(plan: ServingPlan, cb_config: Any) -> ServingPlan:
    """``plan``, noting the padding intervals the caller set (upstream then pads that dimension)."""
    return replace(
        plan,
        queries_by_interval=bool(cb_config.q_padding_interval_size),
        kv_by_interval=bool(cb_config.kv_padding_interval_size),
    )


def capacity(cb_config: Any) -> int | None:
    """Tokens one request may hold in a cache of the resolved config (None: unknown)."""
    blocks, page = getattr(cb_config, "num_blocks", None), getattr(cb_config, "page_size", None)
    return blocks * page if isinstance(blocks, int) and isinstance(page, int) else None


def of(cb_config: Any) -> ServingPlan | None:
    """The plan riding on a resolved ``ContinuousBatchingConfig`` (None: not on Neuron)."""
    return getattr(cb_config, PLAN_ATTR, None)
