"""What continuous batching pads to on Neuron, and how large its KV cache is: the serving plan.

Transformers' continuous batching packs every request of a step into one
``[1, tokens]`` row and reads the KV cache through one index of all their past
tokens, so a step's shape is (query tokens, KV tokens read), both changing at
every step. On Neuron each new shape is a compile, so a step is padded to a
bucket of each, and the compiled step only ever sees the bucket grid:

- query tokens: the ``serving_token_buckets`` setting (``pow2``: 16, 32, ...
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
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from ... import device as neuron_device
from ... import logs, settings
from ...sizes import format_size
from ..compile_options import compile_config
from ..shapes import Buckets, buckets, hook_answer, record_key
from ..shapes import pow2 as pow2_buckets
from ..upstream_features import CB, without_step_padding

logger = logging.getLogger(__name__)

TOKEN_BUCKETS_ENV = settings.env_name("serving_token_buckets")
KV_BUCKETS_ENV = settings.env_name("serving_kv_buckets")
KV_CACHE_ENV = settings.env_name("serving_kv_cache_tokens")
#: Smallest ``pow2`` query bucket: a wave's last decode steps run a few requests (1 to 16 query tokens); at 32 a
#: long-tailed workload computed 1.47 query tokens per real one, at 16 1.21 (one more bucket of the grid).
MIN_TOKEN_BUCKET = 16
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

__all__ = ["CB", "ServingPlan", "apply", "capacity", "of", "resolve", "with_intervals", "without_step_padding"]


@dataclass(frozen=True)
class ServingPlan:
    """The buckets of continuous batching on Neuron, and which dimensions the caller pads upstream's way."""

    token_buckets: Buckets  # the last is the step's token budget (empty: buckets off)
    kv_buckets: Buckets  # the cache's capacity is added as the last at run time
    kv_cache_tokens: int
    compiled: bool = True  # steps padded and compiled (False: buckets off, upstream's eager path)
    queries_by_interval: bool = False  # the caller set q_padding_interval_size: upstream pads queries
    kv_by_interval: bool = False  # the caller set kv_padding_interval_size: upstream pads KV reads
    record: str | None = None  # the model's shape record (the step sizes it sees, for fitted buckets)

    def __post_init__(self) -> None:  # plain lists are accepted (a plugin's, a test's): checked as buckets
        object.__setattr__(self, "token_buckets", Buckets(self.token_buckets, "serving_token_buckets"))
        object.__setattr__(self, "kv_buckets", Buckets(self.kv_buckets, "serving_kv_buckets"))

    def token_grid(self, budget: int) -> Buckets:
        """The query-token buckets under a step budget of ``budget`` tokens (which is the last)."""
        return self.token_buckets.ending_at(budget)

    def kv_grid(self, capacity: int) -> Buckets:
        """The KV buckets for a cache of ``capacity`` tokens (which is the last)."""
        return self.kv_buckets.ending_at(capacity)

    def token_bucket(self, tokens: int, budget: int) -> int:
        """Query tokens a step of ``tokens`` is padded to (``budget``: the step's largest, always a bucket)."""
        return self.token_grid(budget).pad_to(tokens, "continuous batching", "step of query tokens")

    def kv_bucket(self, tokens: int, capacity: int) -> int:
        """KV tokens a step reading ``tokens`` is padded to (upstream reads one interval even when 0)."""
        return self.kv_grid(capacity).pad_to(max(tokens, 1), "continuous batching", "step of KV tokens")

    def grid(
        self, budget: int, capacity: int, max_tokens: int | None = None, max_kv: int | None = None
    ) -> list[tuple[int, int]]:
        """Every (query tokens, KV tokens) shape a step can have: what a warm-up compiles. ``max_tokens`` and
        ``max_kv`` bound a step's query and KV tokens (None: unbounded): only the buckets those reach."""
        return [
            (q, kv)
            for q in self.token_grid(budget).reaching(max_tokens)
            for kv in self.kv_grid(capacity).reaching(max_kv)
        ]


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
    per_token = kv_bytes_per_token(config)
    positions = getattr(config, "max_position_embeddings", None)
    answer = hook_answer(
        "neuron_serving_shape_policy", _KEYS, max_position_embeddings=positions, kv_bytes_per_token=per_token
    )
    cache_tokens = _fitting_cache_tokens(
        settings.resolve("serving_kv_cache_tokens", hook=lambda: answer.get("kv_cache_tokens")), per_token, device
    )
    record = record_key(config)
    tokens = buckets(
        "serving_token_buckets",
        answer,
        "token_buckets",
        lambda: pow2_buckets(MIN_TOKEN_BUCKET, MAX_TOKEN_BUCKET, "serving_token_buckets"),
        record=record,
    )
    kv = buckets(
        "serving_kv_buckets",
        answer,
        "kv_buckets",
        lambda: pow2_buckets(MIN_KV_BUCKET, cache_tokens, "serving_kv_buckets"),
        record=record,
    )
    if not tokens or not kv:
        return ServingPlan(Buckets(), Buckets(), cache_tokens, compiled=False, record=record)
    return ServingPlan(token_buckets=tokens, kv_buckets=kv, kv_cache_tokens=cache_tokens, record=record)


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
        step_config = compile_config("serving")
        if isinstance(step_config, CompileConfig):
            chosen.varlen_compile_config = step_config
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
