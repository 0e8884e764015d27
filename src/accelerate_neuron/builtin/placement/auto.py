"""``device_map="auto"`` on Neuron: the fewest cores that hold the model, balanced over those.

Upstream's ``"auto"`` means ``"balanced"``: spread the layers over every
accelerator. On Neuron that is the wrong default for a model that fits on
fewer cores: every core boundary is a device-to-device transfer in every
forward, and ``generate()`` does not auto-compile a model split across cores
(a compiled graph, a NEFF, runs on one NeuronCore), so its decode step runs
eagerly. So ``"auto"`` here picks the smallest
number of cores whose budgets hold the model with :data:`HEADROOM` to spare
(activations, KV cache) and on which Accelerate's own plan (whole no-split
blocks, its per-device buffers) leaves nothing on the host, and balances over
them; a model that needs every core still spreads over all and offloads as
upstream does.
``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` and an explicit
``max_memory`` keep upstream's meaning.
"""

from __future__ import annotations

import logging
from typing import Any

from ... import device, logs
from ...sizes import format_size

logger = logging.getLogger(__name__)

#: Share of a core's budget the weights may use when choosing how many cores "auto" needs.
HEADROOM = 0.9


def cores_needed(model_bytes: int, budgets: list[int], headroom: float = HEADROOM) -> int | None:
    """The smallest k whose first k budgets hold ``model_bytes`` with headroom; None if none do."""
    total = 0
    for k, budget in enumerate(budgets, start=1):
        total += budget
        if model_bytes <= headroom * total:
            return k
    return None


def _plan_stays_on_cores(model: Any, max_memory: dict[int | str, int]) -> bool:
    """True if upstream's ``"auto"`` plan for ``max_memory`` puts nothing on the CPU or disk."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(model, max_memory=dict(max_memory), no_split_module_classes=no_split)
    plan = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    return not any(value in ("cpu", "disk") for value in plan.values())


def auto_max_memory(model: Any) -> dict[int | str, int] | None:
    """``max_memory`` limiting ``"auto"`` to the cores it needs, or None to keep upstream's plan."""
    from accelerate.utils import compute_module_sizes, get_max_memory

    cores = device.device_count()
    if cores < 2:
        return None
    plan = get_max_memory()  # Neuron budgets (our patch) + host memory
    budgets = [int(plan.get(i, 0)) for i in range(cores)]
    model_bytes = int(compute_module_sizes(model)[""])
    first = cores_needed(model_bytes, budgets)
    if first is None:
        return None
    for k in range(first, cores):
        limited: dict[int | str, int] = {i: budgets[i] for i in range(k)}
        for key in ("cpu", "disk"):
            if key in plan:
                limited[key] = plan[key]
        # The byte count ignores block granularity and Accelerate's buffers: ask its planner.
        if _plan_stays_on_cores(model, limited):
            break
    else:
        return None
    logs.once(
        logger,
        ("placement.auto_cores", model_bytes, k),
        "accelerate_neuron: device_map='auto' places the model (%s) on %d of %d Neuron cores (0..%d): "
        "each core boundary costs a transfer, and generate() compiles a model on one core only. "
        "Pass device_map='balanced' to spread it over every core.",
        format_size(model_bytes),
        k,
        cores,
        k - 1,
        level=logging.INFO,
    )
    return limited
