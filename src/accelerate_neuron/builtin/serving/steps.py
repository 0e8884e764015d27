"""Continuous batching's compiled step on Neuron: padded to the plan's buckets, warmed up over its whole grid.

- ``ModelRunner.maybe_pad_inputs``: a step's (query tokens, KV tokens read)
  go up to their buckets (:mod:`.plan`) instead of upstream's fixed intervals,
  so the compiled step, and the paged cache's update that upstream keeps out of
  the graph (``torch.compiler.disable``), only ever see the bucket grid.
- ``ModelRunner.warmup``: upstream warms the largest shape only (CUDA graphs
  grow from it); on Neuron every shape of the grid is a compile, so the warm-up
  runs one step per (query bucket, KV bucket) a step can reach (:mod:`.warm_grid`:
  announced with its cost first, capped by ``serving_warmup_shapes``): a warm
  server then compiles nothing. In a ``precompile`` worker each shape is claimed through the
  warm-up session, so ``--jobs N`` splits the grid.
- ``ModelRunner.compute_batch``: after that warm-up, a step that still compiles
  is warned about once per shape (it stalls every request for minutes on Neuron).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ... import logs
from ... import padding as _padding
from .. import compile_counter
from .. import precompile_session as session
from ..model_tag import model_tag
from ..shapes import make_room_for_buckets, note
from . import cache_update, warm_grid
from . import plan as serving_plan

logger = logging.getLogger(__name__)

_WARMED = "_accelerate_neuron_warmed_grid"
_WARMING = "_accelerate_neuron_warming"
#: Graphs a step shape adds on a cold cache (precompile's ETA, the warm-up's estimate): the paged cache's update is
#: traced into the step (:mod:`.cache_update`), so a step is one graph.
GRAPHS_PER_SHAPE = 1


def _plan(runner: Any) -> serving_plan.ServingPlan | None:
    plan = serving_plan.of(runner.cb_config)
    if plan is None or not plan.compiled or not getattr(runner, "pad_inputs", False):
        return None
    return plan


def wrap_maybe_pad_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def maybe_pad_inputs(self: Any, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> Any:
        plan = _plan(self)
        padded_q, padded_kv = original(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        if plan is None or use_decode_fast_path:
            return padded_q, padded_kv
        # Dynamo's default limit (8 graphs a frame) would run the steps of later buckets eagerly.
        make_room_for_buckets("continuous batching compiles its step once per (query, KV) bucket")
        if not plan.queries_by_interval:
            padded_q = plan.token_bucket(num_q_tokens, self.cache.max_batch_tokens)
        if not plan.kv_by_interval:
            padded_kv = plan.kv_bucket(max_kv_read, self.cache.max_tokens_read)
        if not getattr(self, _WARMING, False):  # a real step, not one of the warm-up's
            _padding.add("serving", padded_q, num_q_tokens)
            note(plan.record, "serving_token_buckets", num_q_tokens)
            note(plan.record, "serving_kv_buckets", max(max_kv_read, 1))
        return padded_q, padded_kv

    return maybe_pad_inputs


def grid(runner: Any, reach: warm_grid.Reach | None = None) -> list[tuple[int, int]]:
    """The (query tokens, KV tokens) shapes a runner's steps can have (within ``reach``: of that workload)."""
    plan = _plan(runner)
    if plan is None:
        return []
    reach = reach or warm_grid.Reach(None, None)
    return plan.grid(runner.cache.max_batch_tokens, runner.cache.max_tokens_read, reach.query_tokens, reach.kv_tokens)


def wrap_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def warmup(self: Any, model: Any) -> Any:
        full = grid(self)
        if not full:
            return original(self, model)
        shapes, why = warm_grid.choose(full, grid(self, warm_grid.reach_of(self.cb_config)))
        warm_grid.announce(shapes, why, GRAPHS_PER_SHAPE)
        warm = session.current()
        started = time.perf_counter()
        before = compile_counter.compile_count() if compile_counter.ensure_compile_counter() else None
        object.__setattr__(self, _WARMING, True)  # its steps are not the job's: not counted as padding
        try:
            _warm_grid(self, model, shapes, warm)
        finally:
            object.__setattr__(self, _WARMING, False)
        self.cache.reset()  # the warm-up's requests leave no block behind
        setattr(self, _WARMED, set(shapes))
        compiled = "" if before is None else f", {compile_counter.compile_count() - before} Dynamo compile(s)"
        logger.info(
            "accelerate_neuron: continuous batching warmed %d step shape(s) (query tokens x KV tokens) in %.1f s%s",
            len(shapes),
            time.perf_counter() - started,
            compiled,
        )

    return warmup


def _warm_grid(runner: Any, model: Any, shapes: list[tuple[int, int]], warm: Any) -> None:
    """One upstream warm-up step per (query tokens, KV tokens) shape, each claimed when a precompile worker runs."""
    for tokens, kv in shapes:
        shape = {"model": model_tag(model), "tokens": tokens, "kv": kv}
        if warm is not None and not warm.claim("continuous_batching", shape, GRAPHS_PER_SHAPE):
            continue
        shape_started = time.perf_counter()
        # Upstream's own one-step warm-up, at exactly the bucket's sizes (so the step's ints match a real one).
        # It logs and swallows any failure, returning 0 s: this shape then compiles when a step first needs it.
        if not runner.run_one_warmup(model=model, num_q_tokens=tokens, max_kv_read=kv):
            logs.once(
                logger,
                ("serving.warmup_failed", tokens, kv),
                "accelerate_neuron: continuous batching could not warm the step of %d query tokens and %d KV "
                "tokens (see upstream's warning above): it will compile when a step first needs it.",
                tokens,
                kv,
            )
        elif warm is not None:
            warm.done("continuous_batching", shape, time.perf_counter() - shape_started)


def wrap_compute_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> Any:
        cache_update.prepare(self.cache)  # eagerly, before the step is traced: it updates the cache inline
        warmed = getattr(self, _WARMED, None)
        if not warmed or not compile_counter.ensure_compile_counter():
            return original(self, model, batch_data)
        before = compile_counter.compile_count()
        result = original(self, model, batch_data)
        if compile_counter.compile_count() > before:
            _warn_compiled_after_warmup(batch_data, warmed)
        return result

    return compute_batch


def step_shape(batch_data: dict[str, Any]) -> tuple[int, int]:
    """(query tokens, KV tokens read) of a step's model inputs."""
    tokens = int(batch_data["input_ids"].shape[-1])
    reads = batch_data.get("read_index") or []
    read = int(reads[0].numel()) if reads else 0
    return tokens, max(read - tokens, 0)


def _warn_compiled_after_warmup(batch_data: dict[str, Any], warmed: set[tuple[int, int]]) -> None:
    shape = step_shape(batch_data)
    why = "a shape outside the warmed grid" if shape not in warmed else "a shape the warm-up ran (Dynamo recompiled)"
    logs.once(
        logger,
        ("serving.compiled_after_warmup", shape),
        "accelerate_neuron: continuous batching compiled a new graph after its warm-up, for a step of %d query tokens "
        "and %d KV tokens (%s): on Neuron a compile stalls every request for minutes. Check that nothing changed the "
        "model or its settings between the warm-up and serving (see docs/serving.md).",
        shape[0],
        shape[1],
        why,
    )
