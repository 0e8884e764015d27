"""The simulated ``"neuron"`` torch.compile backend.

Like torch-neuronx, it hands AOTAutograd's graphs (forward, backward, or a
single inference graph) to "the compiler", through the NEFF cache
(:mod:`.neff_cache`): a graph already compiled, by this process or by an
earlier or concurrent one sharing the cache, is a hit and costs no compile.
Here compiling means recording the graph, its input shapes and its cache entry;
running it executes the graph's aten ops on the device with eager-signature
counting suspended, because on Neuron those ops are one compiled NEFF, not
op-by-op eager work. Hit or miss, the graph runs the same way on the CPU.

Registered only by the simulator: a real torch-neuronx registers its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..compile_cache import keys, outcomes
from . import graph_key, neff_cache
from .runtime import state

logger = logging.getLogger(__name__)

BACKEND_NAME = "neuron"

_lock = threading.Lock()
_graphs: list[dict[str, Any]] = []
_dynamo_graphs = 0
#: Index of the first graph ``torch.neuron.get_dynamo_metrics()`` reports (``reset_dynamo_metrics()`` moves it).
_metrics_start = 0


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {
            "shape": [str(s) if not isinstance(s, int) else s for s in value.shape],
            "dtype": str(value.dtype).removeprefix("torch."),
            "device": str(value.device),
        }
    if isinstance(value, torch.SymInt | int):
        return {"value": str(value)}
    return {"type": type(value).__name__}


def _input_names(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        name = getattr(source, "name", None) if source is not None else None
        if callable(name):
            name = name()
        names.append(name if isinstance(name, str) else node.name)
    return names


def _compile_context() -> dict[str, Any]:
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        return {"compile_id": str(compile_id) if compile_id is not None else None}
    except Exception:  # private API; the record is still useful without it
        return {"compile_id": None}


def _frame_of(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    """The Python frame Dynamo compiled (and the graph break that ended it), for dry-run reports."""
    try:  # Dynamo's own note on the graph; not a public API, so the record goes without it if absent
        reason = gm.compile_subgraph_reason
        root, last = reason.user_stack[0], reason.user_stack[-1]
        return {
            "function": root.name,
            "file": root.filename,
            "line": root.lineno,
            "graph_break": f"{last.filename}:{last.lineno}: {reason.reason.splitlines()[0]}"
            if reason.graph_break
            else None,
        }
    except Exception:
        return None


def _through_cache(
    record: dict[str, Any], gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any]
) -> None:
    """Look the graph up in the NEFF cache ("compiling" it on a miss); note the outcome in ``record``."""
    try:
        key = graph_key.graph_key(gm, example_inputs, kind=record["kind"], options=options)
    except Exception as exc:  # an unforeseen graph must still run: it then counts as compiled
        logger.debug("accelerate_neuron: no NEFF cache key for a %s graph (%s)", record["kind"], exc)
        record.update(cache=neff_cache.MISS, cache_source="unkeyed", cache_key=None)
        return
    summary = {"what": "graph", **{k: record[k] for k in ("kind", "inputs", "num_nodes", "frame")}}
    made_by = outcomes.labels()
    if made_by:
        summary["made_by"] = made_by
    try:
        lookup = neff_cache.current().get_or_compile(
            key, lambda: {**summary, **graph_key.versions(), "key_inputs": keys.key_inputs(simulated=True)}
        )
    except Exception as exc:  # the cache is an optimisation: a failure in it never stops the user's graph
        logger.warning("accelerate_neuron: NEFF cache lookup failed (%s); the graph counts as compiled", exc)
        record.update(cache=neff_cache.MISS, cache_source="error", cache_key=key)
        return
    record.update(cache=lookup.status, cache_source=lookup.source, cache_key=key)
    outcomes.record(lookup.source)


def _has_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph communicates (functional collectives: ``_c10d_functional.*`` ops)."""
    return any("c10d" in str(node.target) for node in gm.graph.nodes if node.op == "call_function")


#: Op namespaces the backend lowers itself; an op of any other namespace is a library's custom op.
_LOWERED_NAMESPACES = ("aten", "prims", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _host_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's ops the real compiler could not put in the NEFF: the CPU fallback table's ops (no lowering)
    and other libraries' custom ops (a Python body, e.g. ``transformers::grouped_mm_fallback``)."""
    from . import cpu_fallback

    fallback = set(cpu_fallback.ops())
    found = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target.name().split(".")[0]  # "aten::histc", "transformers::grouped_mm_fallback"
        if name in fallback or name.split("::")[0] not in _LOWERED_NAMESPACES:
            found.add(name)
    return sorted(found)


def _make_compiler(kind: str, dynamo_index: int, context: dict[str, Any], options: Mapping[str, Any]) -> Callable:
    def compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        record = {
            "kind": kind,
            "dynamo_graph": dynamo_index,
            "compile_id": context.get("compile_id"),
            "dynamo_inputs": context.get("dynamo_inputs", []),
            "frame": context.get("frame"),
            "inputs": [_describe(x) for x in example_inputs],
            "num_nodes": sum(1 for _ in gm.graph.nodes),
            "has_collectives": _has_collectives(gm),
            "host_ops": _host_ops(gm),
        }
        _through_cache(record, gm, example_inputs, options)
        with _lock:
            record["index"] = len(_graphs)
            _graphs.append(record)
        lib = state().lib

        def run(args: list[Any]) -> Any:
            lib.nsim_suspend_counting(1)
            try:
                return gm(*args)
            finally:
                lib.nsim_suspend_counting(-1)

        run._boxed_call = True  # AOTAutograd passes the argument list itself
        return run

    return compiler


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    """torch.compile backend ``"neuron"`` of the simulated device."""
    from torch._dynamo.backends.common import aot_autograd

    global _dynamo_graphs
    with _lock:
        dynamo_index = _dynamo_graphs
        _dynamo_graphs += 1
    context = _compile_context()
    context["frame"] = _frame_of(gm)
    names = _input_names(gm)
    context["dynamo_inputs"] = [{"name": n, **_describe(x)} for n, x in zip(names, example_inputs, strict=False)]
    backend = aot_autograd(
        fw_compiler=_make_compiler("forward", dynamo_index, context, options),
        bw_compiler=_make_compiler("backward", dynamo_index, context, options),
        inference_compiler=_make_compiler("inference", dynamo_index, context, options),
    )
    return backend(gm, example_inputs)


def register(_module: object = None) -> None:
    """Make ``torch.compile(backend="neuron")`` use the simulated backend."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if _BACKENDS.get(BACKEND_NAME) is None:
        register_backend(neuron_backend, name=BACKEND_NAME)


def graph_records(since_metrics_reset: bool = False) -> list[dict[str, Any]]:
    with _lock:
        return [dict(r) for r in _graphs[_metrics_start if since_metrics_reset else 0 :]]


def reset_metrics() -> None:
    """``reset_dynamo_metrics()``: later metrics list only graphs compiled from now on (stats() keep them)."""
    global _metrics_start
    with _lock:
        _metrics_start = len(_graphs)


def cache_counts() -> tuple[int, int]:
    """(graphs compiled, graphs loaded from the NEFF cache) since the last reset."""
    with _lock:
        hits = sum(1 for r in _graphs if r.get("cache") == neff_cache.HIT)
        return len(_graphs) - hits, hits


def dynamo_graph_count() -> int:
    with _lock:
        return _dynamo_graphs


def reset() -> None:
    global _dynamo_graphs, _metrics_start
    with _lock:
        _graphs.clear()
        _dynamo_graphs = 0
        _metrics_start = 0
