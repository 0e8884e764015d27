"""What mixture-of-experts layers computed on Neuron: the experts' FLOPs against a sparse dispatch, and drops.

Every experts call the ``moe`` plugin runs on Neuron notes its shape here (:func:`note_call`):
which implementation ran, tokens, ``top_k``, experts, the rows it multiplied (``experts x tokens``
for dense experts, ``blocks x B`` for blockwise ones, the pairs for gathered ones) and the FLOPs of
one row through one expert (its up/gate and down projections, ``2 x`` the weights' elements per
expert). A sparse dispatch, the ideal, multiplies exactly ``tokens x top_k`` rows. Since every
implementation's shapes are fixed by the call's shape, so is that ratio: a compiled graph computes
what its trace noted, on every launch. ``accelerate-neuron simulate`` prints :func:`snapshot`;
``accelerate_neuron.moe_stats()`` returns it.

A call that runs eagerly is counted each time; inside a compiled graph the note runs once, while
Dynamo traces it (:func:`torch._dynamo.assume_constant_result`: executed at trace time, nothing in
the graph), so a compiled shape is listed with ``compiled: True`` and its eager ``calls`` only.

Drops (capacity mode only, ``moe_capacity_factor``) are a tensor each experts module keeps of its
last call (``neuron_moe_dropped``; a module attribute set inside a compiled graph is set after every
launch), read when asked: :func:`dropped_pairs`.

A base-layer module: the plugin writes here, the simulator's report and the public API read here.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from .import_hooks import when_imported

_lock = threading.Lock()
#: (implementation, tokens, top_k, experts, rows, row_flops) -> [eager calls, traced by Dynamo]
_calls: dict[tuple[str, int, int, int, int, int], list[Any]] = {}
#: The attribute an experts module keeps its last call's dropped pairs in (capacity mode).
DROPPED_ATTR = "neuron_moe_dropped"


def note_call(implementation: str, tokens: int, top_k: int, experts: int, rows: int, row_flops: int) -> bool:
    """One experts call: ``rows`` rows through one expert each, ``row_flops`` FLOPs per row."""
    import torch

    key = (implementation, tokens, top_k, experts, rows, row_flops)
    traced = torch.compiler.is_compiling()
    with _lock:
        entry = _calls.setdefault(key, [0, False])
        if traced:
            entry[1] = True
        else:
            entry[0] += 1
    return True


def _run_while_tracing(dynamo: ModuleType) -> None:
    # Marked once Dynamo exists (importing it here would slow down ``import torch``), before anything is traced.
    dynamo.assume_constant_result(note_call)


when_imported("torch._dynamo", _run_while_tracing)


def reset() -> None:
    with _lock:
        _calls.clear()


def dropped_pairs(model: Any) -> int:
    """The pairs ``model``'s experts dropped in their last call each (capacity mode), summed over its layers."""
    total = 0
    for module in model.modules():
        dropped = getattr(module, DROPPED_ATTR, None)
        if dropped is not None:
            total += int(dropped)
    return total


def snapshot() -> dict[str, Any]:
    """Per call shape: the experts' FLOPs per token, the sparse ideal's, their ratio; and over the eager calls."""
    with _lock:
        calls = {key: list(entry) for key, entry in _calls.items()}
    shapes = []
    computed = ideal = 0
    for (implementation, tokens, top_k, experts, rows, row_flops), (count, traced) in sorted(calls.items()):
        pairs = tokens * top_k
        computed += count * rows * row_flops
        ideal += count * pairs * row_flops
        shapes.append(
            {
                "implementation": implementation,
                "tokens": tokens,
                "top_k": top_k,
                "experts": experts,
                "rows": rows,
                "calls": count,
                "compiled": traced,
                "flops_per_token": rows * row_flops / max(1, tokens),
                "sparse_flops_per_token": top_k * row_flops,
                "ratio": rows / max(1, pairs),
            }
        )
    return {
        "shapes": shapes,
        "eager_experts_flops": computed,
        "eager_sparse_flops": ideal,
        "eager_ratio": computed / ideal if ideal else None,
    }
