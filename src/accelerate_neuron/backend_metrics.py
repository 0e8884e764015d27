"""What the Neuron backend reports about itself: graph compiles, NEFF cache counters, CPU fallbacks.

The one place that reads torch-neuronx's own metrics (:mod:`.device` is the one place that asks
``torch.neuron`` about cores and memory). Every function is feature-detected and read defensively:
a name that is absent, or raises, gives ``None`` for that figure (logged at debug level), never an
error in the caller. The simulated device offers the same functions with the same result shapes
(:mod:`accelerate_neuron.simulator.backend_api`), so this code runs the same path in tests.

What is read, with where it is documented:

- compile metrics: ``torch.neuron.get_dynamo_metrics()``, else ``torch_neuronx.get_dynamo_metrics()``
  (Neuron docs, torch.compile backend reference: the ``neuron_dynamo_backend`` helper API): one record
  per graph the ``"neuron"`` backend compiled, with ``graph_id``, ``graph_name``, ``graph_node_count``,
  ``has_collectives`` and the ``torch_neuronx_{fx_passes,lower,compile}_us`` timings. On the real
  backend the call synchronizes the device (compiles finish asynchronously).
- NEFF cache counters: ``torch_neuronx.metrics.get_counter_value("CompilationCache.<name>")``, ``None``
  until a counter is first incremented (read from torch-neuronx's sources and its users' code, not
  from a reference page: verify on trn2).
- CPU fallbacks: ``torch_neuronx.get_fallback_ops()`` (Neuron docs, Supported PyTorch APIs and
  operators: how to find the ops that ran on the CPU), one op name per call.

``torch_neuronx`` is taken from ``sys.modules`` (a real host imported it with torch); only when a
Neuron device is registered and it is not loaded yet is it imported (on the simulator: its stand-in).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import device

logger = logging.getLogger("accelerate_neuron")

#: torch_neuronx.metrics counters read, and the names they are reported under.
CACHE_COUNTERS = {
    "CompilationCache.TotalCompilations": "compilations",
    "CompilationCache.PersistentHits": "persistent_hits",
    "CompilationCache.PersistentMisses": "persistent_misses",
    "CompilationCache.InMemoryHits": "in_memory_hits",
}


@dataclass(frozen=True)
class GraphCompile:
    """One graph the backend compiled, from its compile metrics."""

    graph_id: str
    name: str
    nodes: int
    has_collectives: bool
    #: FX passes + lowering + neuronx-cc, as the backend measured them (0 where it measured nothing).
    compile_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "graph_id": self.graph_id,
            "name": self.name,
            "nodes": self.nodes,
            "has_collectives": self.has_collectives,
            "compile_seconds": self.compile_seconds,
        }


@dataclass(frozen=True)
class Snapshot:
    """The backend's figures at one moment; a figure the backend does not offer is ``None``."""

    graphs: tuple[GraphCompile, ...] | None = None
    cache: dict[str, int] | None = None
    fallbacks: dict[str, int] | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "graphs": None if self.graphs is None else [g.as_dict() for g in self.graphs],
            "graphs_compiled": None if self.graphs is None else len(self.graphs),
            "compile_seconds": None if self.graphs is None else sum(g.compile_seconds for g in self.graphs),
            "cache": self.cache,
            "cpu_fallbacks": self.fallbacks,
            "cpu_fallback_calls": None if self.fallbacks is None else sum(self.fallbacks.values()),
            "sources": dict(self.sources),
        }


def _torch_neuronx() -> Any | None:
    module = sys.modules.get("torch_neuronx")
    if module is not None or device.neuron_module() is None:
        return module
    try:
        return importlib.import_module("torch_neuronx")
    except Exception as exc:
        logger.debug("accelerate_neuron: torch_neuronx cannot be imported for its metrics: %s", exc)
        return None


def _function(owner: Any, name: str) -> Any | None:
    fn = getattr(owner, name, None) if owner is not None else None
    return fn if callable(fn) else None


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


def compile_metrics() -> tuple[tuple[GraphCompile, ...], str] | None:
    """The backend's per-graph compile records and where they were read; ``None`` where it offers none."""
    for owner_name, owner in (("torch.neuron", device.neuron_module()), ("torch_neuronx", _torch_neuronx())):
        fn = _function(owner, "get_dynamo_metrics")
        if fn is None:
            continue
        try:
            records = list(fn())
            graphs = tuple(
                GraphCompile(
                    graph_id=str(getattr(r, "graph_id", "")),
                    name=str(getattr(r, "graph_name", "") or getattr(r, "graph_id", "")),
                    nodes=_int(getattr(r, "graph_node_count", 0)),
                    has_collectives=bool(getattr(r, "has_collectives", False)),
                    compile_seconds=sum(
                        _int(getattr(r, f"torch_neuronx_{phase}_us", 0)) for phase in ("fx_passes", "lower", "compile")
                    )
                    / 1e6,
                )
                for r in records
            )
        except Exception as exc:
            logger.debug("accelerate_neuron: %s.get_dynamo_metrics() failed: %s", owner_name, exc)
            return None
        return graphs, f"{owner_name}.get_dynamo_metrics()"
    return None


def cache_counters() -> dict[str, int] | None:
    """NEFF compilation cache counters; ``None`` where the backend keeps none (or none was ever incremented)."""
    neuronx = _torch_neuronx()
    metrics = sys.modules.get("torch_neuronx.metrics") or getattr(neuronx, "metrics", None)
    fn = _function(metrics, "get_counter_value")
    if fn is None:
        return None
    try:
        raw = {name: fn(counter) for counter, name in CACHE_COUNTERS.items()}
    except Exception as exc:
        logger.debug("accelerate_neuron: torch_neuronx.metrics.get_counter_value() failed: %s", exc)
        return None
    if all(value is None for value in raw.values()):
        return None  # nothing counted: metrics off (or nothing compiled), not "0 hits"
    return {name: _int(value) for name, value in raw.items()}


def fallback_ops() -> dict[str, int] | None:
    """Calls per op that ran on the CPU (first seen first); ``None`` where the backend does not track them."""
    fn = _function(_torch_neuronx(), "get_fallback_ops")
    if fn is None:
        return None
    try:
        return dict(Counter(str(op) for op in fn()))
    except Exception as exc:
        logger.debug("accelerate_neuron: torch_neuronx.get_fallback_ops() failed: %s", exc)
        return None


def snapshot() -> Snapshot:
    """Everything the backend reports now (cumulative since it started, or since its own resets)."""
    if device.neuron_module() is None:
        return Snapshot()
    compiled = compile_metrics()
    sources = {}
    if compiled is not None:
        sources["graphs"] = compiled[1]
    cache = cache_counters()
    if cache is not None:
        sources["cache"] = "torch_neuronx.metrics.get_counter_value()"
    fallbacks = fallback_ops()
    if fallbacks is not None:
        sources["cpu_fallbacks"] = "torch_neuronx.get_fallback_ops()"
    return Snapshot(compiled[0] if compiled else None, cache, fallbacks, sources)


def since(later: Snapshot, earlier: Snapshot) -> Snapshot:
    """What happened between two snapshots (a figure missing from either stays ``None``)."""
    graphs = None
    if later.graphs is not None and earlier.graphs is not None:
        # The backend's list only grows, unless someone reset it in between: then it all is new.
        ids = [(g.graph_id, g.name) for g in later.graphs[: len(earlier.graphs)]]
        seen = len(earlier.graphs) if ids == [(g.graph_id, g.name) for g in earlier.graphs] else 0
        graphs = later.graphs[seen:]
    cache = None
    if later.cache is not None:
        before = earlier.cache or {}
        cache = {k: max(0, v - before.get(k, 0)) for k, v in later.cache.items()}
    fallbacks = None
    if later.fallbacks is not None:
        fallbacks = dict(Counter(later.fallbacks) - Counter(earlier.fallbacks or {}))
    return Snapshot(graphs, cache, fallbacks, dict(later.sources))
