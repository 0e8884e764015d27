"""The simulated device's own metrics API, shaped like torch-neuronx's.

A real host answers these from torch-neuronx; here they are answered from the simulator's records,
with the same names and result shapes, so the code that reads them
(:mod:`accelerate_neuron.backend_metrics`) runs the same path in tests as on Trainium:

- ``torch.neuron.get_dynamo_metrics()`` / ``torch_neuronx.get_dynamo_metrics()``: one
  :class:`NeuronCompilationMetrics` per graph handed to the ``"neuron"`` torch.compile backend
  (forward, backward or inference graph), and ``reset_dynamo_metrics()``.
- ``torch_neuronx.metrics.get_counter_value(name)``: the NEFF compilation cache's counters
  (:data:`COUNTERS`), ``None`` until a counter is first incremented, as on the real backend.
- ``torch_neuronx.get_fallback_ops()`` / ``clear_op_tracking()``: the ops that ran on the CPU
  (:mod:`.cpu_fallback`), one name per call.

Not modelled: timings (the ``*_us`` fields are 0: the simulator compiles nothing), and the
in-memory cache hits of eager ops (``CompilationCache.InMemoryHits`` counts only graphs found
compiled earlier in this process).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from . import compile_backend, cpu_fallback, neff_cache

#: The torch_neuronx.metrics counters of the NEFF compilation cache that the simulator keeps.
COUNTERS = (
    "CompilationCache.TotalCompilations",
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.InMemoryHits",
)


@dataclass
class NeuronCompilationMetrics:
    """Per-graph compile record, with torch-neuronx's field names."""

    graph_id: str
    graph_name: str = ""
    model_name: str = ""
    has_collectives: bool = False
    graph_node_count: int = 0
    timestamp: str = ""
    torch_neuronx_fx_passes_us: int = 0
    torch_neuronx_lower_us: int = 0
    torch_neuronx_compile_us: int = 0


def get_dynamo_metrics() -> list[NeuronCompilationMetrics]:
    """One record per graph the ``"neuron"`` backend received since the last reset."""
    out = []
    for record in compile_backend.graph_records(since_metrics_reset=True):
        out.append(
            NeuronCompilationMetrics(
                graph_id=str(record.get("cache_key") or f"unkeyed-{record['index']}"),
                graph_name=f"model_{record['dynamo_graph']}_{record['kind']}_{record['index']}",
                model_name="model",
                has_collectives=bool(record.get("has_collectives")),
                graph_node_count=int(record.get("num_nodes", 0)),
                timestamp=str(record["index"]),
            )
        )
    return out


def reset_dynamo_metrics() -> None:
    compile_backend.reset_metrics()


def _counter_values() -> dict[str, int]:
    from . import stats

    st = stats()
    graphs = st["graphs"]
    compilations = st["compiles"] + st["eager_compiles"]
    in_memory = sum(1 for g in graphs if g.get("cache") == neff_cache.HIT and g.get("cache_source") == "memory")
    persistent = st["compile_cache_hits"] - in_memory + st["eager_cache_hits"]
    values = {
        "CompilationCache.TotalCompilations": compilations,
        "CompilationCache.PersistentHits": persistent,
        "CompilationCache.InMemoryHits": in_memory,
    }
    if st["compile_cache"].get("enabled"):
        values["CompilationCache.PersistentMisses"] = compilations
    return values


def get_counter_value(name: str) -> int | None:
    """A counter's value; ``None`` for a counter never incremented (or not kept by the simulator)."""
    value = _counter_values().get(name)
    return value if value else None


def get_fallback_ops() -> list[str]:
    """The ops that ran on the CPU, one entry per call (grouped by op, first seen first)."""
    return [name for name, n in cpu_fallback.counts().items() for _ in range(n)]


def clear_op_tracking() -> None:
    cpu_fallback.clear_counts()


def metrics_module() -> types.ModuleType:
    """``torch_neuronx.metrics`` of the stand-in package."""
    module = types.ModuleType("torch_neuronx.metrics")
    module.__doc__ = "Counters of the simulated NEFF compilation cache (see accelerate_neuron.simulator.backend_api)."
    module.get_counter_value = get_counter_value
    return module


def attach(module: types.ModuleType) -> None:
    """Give the stand-in ``torch_neuronx`` package the functions above."""
    module.get_dynamo_metrics = get_dynamo_metrics
    module.reset_dynamo_metrics = reset_dynamo_metrics
    module.get_fallback_ops = get_fallback_ops
    module.clear_op_tracking = clear_op_tracking
    module.metrics = metrics_module()
