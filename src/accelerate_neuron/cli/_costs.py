"""The compile-cost model behind the dry-run estimates (DESIGN.md: compiles, not FLOPs, decide wall time).

On Neuron every distinct input signature of a compiled graph is a new NEFF
(neuronx-cc takes ~25-140 s per graph, minutes for large ones), and eager mode
compiles op by op, once per (op, shapes, dtypes). The defaults below are
assumptions, printed next to every estimate and overridable per run.
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
) -> dict[str, Any]:
    """First-run compile time on Trainium for ``graphs`` NEFFs and ``eager_signatures`` op compiles."""
    return {
        "graphs": graphs,
        "eager_signatures": eager_signatures,
        "seconds_per_graph": seconds_per_graph,
        "seconds_per_eager_signature": seconds_per_signature,
        "seconds": graphs * seconds_per_graph + eager_signatures * seconds_per_signature,
    }


def describe(est: dict[str, Any]) -> str:
    """``3 graphs x 60 s + 120 eager signatures x 2 s``: the assumption behind an estimate."""
    return (
        f"{est['graphs']} graph(s) x {est['seconds_per_graph']:g} s + "
        f"{est['eager_signatures']} eager signature(s) x {est['seconds_per_eager_signature']:g} s"
    )
