"""The adapters between upstream's continuous batching and the serving plan: thin, each asks :mod:`.plan`.

- ``resolve_continuous_batching_config``: for a model on Neuron, the caller's
  config (copied) gets the plan's token budget, cache size, request cap and
  the ``"neuron"`` compile config of the step where the caller set none; the
  plan rides on the resolved config for the model runner to read.
- ``ContinuousBatchingManager.add_request`` and ``generate_batch``: a request
  that cannot fit the KV cache (prompt + ``max_new_tokens`` beyond its
  capacity, the largest KV bucket) is refused with a ``ValueError`` naming the
  sizes and the setting, instead of waiting forever for room.
- ``transformers serve``'s ``CBGenerateManager.init_cb`` (releases up to 5.24):
  it starts continuous batching at the first request without upstream's
  warm-up, so every step shape would compile on a live request; on Neuron the
  manager is warmed (the whole grid, :mod:`.steps`) before it starts. Later
  releases warm it themselves when the model loads.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ... import device as neuron_device
from ... import logs
from ..model_devices import model_device
from . import plan as serving_plan
from . import warm_grid

logger = logging.getLogger(__name__)


def wrap_resolve_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """``resolve_continuous_batching_config``: Neuron's plan filled in, then upstream's own resolution."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def resolve(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        device = bound.arguments.get("device")
        if device is None or not neuron_device.is_neuron(device):
            return original(*args, **kwargs)
        config, cb_config = bound.arguments["config"], bound.arguments["cb_config"]
        plan = serving_plan.with_intervals(serving_plan.resolve(config, device), cb_config)
        bound.arguments["cb_config"] = serving_plan.apply(plan, cb_config)
        resolved = original(*bound.args, **bound.kwargs)
        if plan.compiled and resolved.varlen_compile_config is None:
            plan = replace(plan, compiled=False)  # e.g. a flash attention varlen path upstream does not compile
        setattr(resolved, serving_plan.PLAN_ATTR, plan)
        warm_grid.note(resolved, bound.arguments.get("workload_hints"))
        if plan.compiled:
            _announce(plan, resolved)
        return resolved

    return resolve


def _announce(plan: serving_plan.ServingPlan, resolved: Any) -> None:
    capacity = serving_plan.capacity(resolved) or plan.kv_cache_tokens
    tokens = [b for b in plan.token_buckets if b < resolved.max_batch_tokens] + [resolved.max_batch_tokens]
    logs.once(
        logger,
        "serving.plan",
        "accelerate_neuron: continuous batching on Neuron pads each step to query-token buckets (%s) and KV buckets "
        "(%s), compiles the step with the 'neuron' backend and warms the shapes a step can reach up front, so a warm "
        "server compiles nothing; its KV cache holds %d tokens. Settings: %s, %s, %s (off: upstream's eager path).",
        ", ".join(map(str, tokens)),
        ", ".join(map(str, plan.kv_grid(capacity))),
        capacity,
        serving_plan.TOKEN_BUCKETS_ENV,
        serving_plan.KV_BUCKETS_ENV,
        serving_plan.KV_CACHE_ENV,
        level=logging.INFO,
    )


def _too_long(cb_config: Any, lengths: Sequence[tuple[Any, int]]) -> str | None:
    """Why some requests (label, prompt + new tokens) cannot fit the cache of ``cb_config``, or None."""
    if serving_plan.of(cb_config) is None:
        return None
    capacity = serving_plan.capacity(cb_config)
    if capacity is None:
        return None
    over = [(label, total) for label, total in lengths if total > capacity]
    if not over:
        return None
    shown = ", ".join(f"{label}: {total}" for label, total in over[:5]) + (", ..." if len(over) > 5 else "")
    return (
        f"request(s) longer than continuous batching's KV cache on Neuron ({capacity} tokens, the largest KV bucket): "
        f"{shown} tokens (prompt + max_new_tokens). Shorten them, lower max_new_tokens, or raise "
        f"{serving_plan.KV_CACHE_ENV} (or ContinuousBatchingConfig(num_blocks=...))."
    )


def wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ContinuousBatchingManager.add_request``: a request that cannot fit the cache is refused at once."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs).arguments
        new = arguments.get("max_new_tokens")
        if new is None:
            new = getattr(self.generation_config, "max_new_tokens", None) or 0
        label = arguments.get("request_id") or "the request"
        problem = _too_long(self.continuous_batching_config, [(label, len(arguments["input_ids"]) + new)])
        if problem is not None:
            raise ValueError(problem)
        return original(self, *args, **kwargs)

    return add_request


def wrap_generate_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``generate_batch``: every input checked against the cache before any request starts."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not neuron_device.is_neuron(getattr(self, "device", None)):
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        inputs = arguments.get("inputs") or []
        extra = arguments.get("kwargs") or {}
        config = arguments.get("generation_config") or self.generation_config
        new = extra.get("max_new_tokens", getattr(config, "max_new_tokens", None)) or 0
        cb_config = _resolved_for(self, arguments.get("continuous_batching_config"))
        problem = _too_long(cb_config, [(f"input {i}", len(ids) + new) for i, ids in enumerate(inputs)])
        if problem is not None:
            # Upstream logs an error raised while adding requests and returns what finished (nothing): say it.
            raise ValueError(problem)
        return original(self, *args, **kwargs)

    return generate_batch


def _resolved_for(model: Any, cb_config: Any) -> Any:
    """The plan-filled config the manager of this call will have (for its capacity), without building it."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        return cached.continuous_batching_config
    plan = serving_plan.resolve(model.config.get_text_config(), model.device)
    chosen = serving_plan.apply(plan, cb_config or ContinuousBatchingConfig())
    setattr(chosen, serving_plan.PLAN_ATTR, plan)
    return chosen


def wrap_serve_init_cb(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CBGenerateManager.init_cb``: on Neuron, the manager it creates is warmed before it starts."""

    @functools.wraps(original)
    def init_cb(self: Any, model: Any, gen_config: Any) -> Any:
        if (
            getattr(self, "_cb", None) is not None
            or model_device(model) is None
            or "init_continuous_batching" in vars(model)
        ):
            return original(self, model, gen_config)
        create = model.init_continuous_batching

        def init_and_warm(*args: Any, **kwargs: Any) -> Any:
            manager = create(*args, **kwargs)
            if not getattr(manager, "warmed_up", True):
                manager.warmup()
            return manager

        # Upstream creates and starts the manager in one call: the warm-up goes between the two, for this call only.
        vars(model)["init_continuous_batching"] = init_and_warm
        try:
            return original(self, model, gen_config)
        finally:
            vars(model).pop("init_continuous_batching", None)

    return init_cb
