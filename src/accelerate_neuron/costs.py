"""The compile-cost model behind the dry-run estimates: compiles, not FLOPs, decide wall time on Neuron.

On Neuron every distinct input signature of a compiled graph is a new NEFF
(neuronx-cc takes ~25-140 s per graph, minutes for large ones), and eager mode
compiles op by op, once per (op, shapes, dtypes). The defaults below are
assumptions, printed next to every estimate and overridable per run.

A NEFF found in the persistent cache (graph or eager op) is loaded instead of
compiled: counted as 0 s here (torch-neuronx loads a cached NEFF in well under
a second; to verify on trn2). A warm cache saves the difference between the
cold-cache estimate and this run's.
"""

from __future__ import annotations

from typing import Any

#: Seconds neuronx-cc spends per compiled graph (midpoint-ish of the 25-140 s range).
SECONDS_PER_GRAPH = 60.0
#: Seconds per eager signature: a one-op NEFF is small, but each still goes through the compiler.
SECONDS_PER_EAGER_SIGNATURE = 2.0


def estimate(
    graphs: int,
    eager_signatures: int,
    seconds_per_graph: float = SECONDS_PER_GRAPH,
    seconds_per_signature: float = SECONDS_PER_EAGER_SIGNATURE,
    *,
    cached_graphs: int = 0,
    cached_signatures: int = 0,
) -> dict[str, Any]:
    """Compile time on Trainium for ``graphs`` NEFFs and ``eager_signatures`` op compiles (cache misses).

    ``cached_*``: what the NEFF cache supplied instead; ``cold_seconds`` is what the same work
    costs on an empty cache, ``saved_seconds`` what the cache saved.
    """
    seconds = graphs * seconds_per_graph + eager_signatures * seconds_per_signature
    cold = seconds + cached_graphs * seconds_per_graph + cached_signatures * seconds_per_signature
    return {
        "graphs": graphs,
        "eager_signatures": eager_signatures,
        "cached_graphs": cached_graphs,
        "cached_signatures": cached_signatures,
        "seconds_per_graph": seconds_per_graph,
        "seconds_per_eager_signature": seconds_per_signature,
        "seconds": seconds,
        "cold_seconds": cold,
        "saved_seconds": cold - seconds,
    }


def describe(est: dict[str, Any]) -> str:
    """``3 graphs x 60 s + 120 eager signatures x 2 s``: the assumption behind an estimate."""
    return (
        f"{est['graphs']} graph(s) x {est['seconds_per_graph']:g} s + "
        f"{est['eager_signatures']} eager signature(s) x {est['seconds_per_eager_signature']:g} s"
    )


def describe_cache(graphs: int, signatures: int) -> str:
    """``2 graph(s) and 64 eager signature(s) loaded from the NEFF cache``, or that nothing was."""
    if not (graphs or signatures):
        return "nothing was loaded from the NEFF cache"
    return f"{graphs} graph(s) and {signatures} eager signature(s) loaded from the NEFF cache"
