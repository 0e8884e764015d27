"""``device_map="auto"`` on Neuron: the fewest cores that hold the model, balanced over those.

Upstream's ``"auto"`` means ``"balanced"``: spread the layers over every
accelerator. On Neuron that is the wrong default for a model that fits on
fewer cores: every core boundary is a transfer in the forward, and
Accelerate's dispatch hooks split a compiled forward into one graph per
segment (a model spread over 3 cores decoded with a static cache compiled 13
graphs instead of 1 on the simulator). So ``"auto"`` here picks the smallest
number of cores whose budgets hold the model with :data:`HEADROOM` to spare
(activations, KV cache) and balances over them; a model bigger than every
core still spreads over all and offloads as upstream does.
``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` and an explicit
``max_memory`` keep upstream's meaning.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import device
from ..sizes import format_size

logger = logging.getLogger("accelerate_neuron")

#: Share of a core's budget the weights may use when choosing how many cores "auto" needs.
HEADROOM = 0.9

_logged: set[tuple[int, int]] = set()


def cores_needed(model_bytes: int, budgets: list[int], headroom: float = HEADROOM) -> int | None:
    """The smallest k whose first k budgets hold ``model_bytes`` with headroom; None if none do."""
    total = 0
    for k, budget in enumerate(budgets, start=1):
        total += budget
        if model_bytes <= headroom * total:
            return k
    return None


def auto_max_memory(model: Any) -> dict[int | str, int] | None:
    """``max_memory`` limiting ``"auto"`` to the cores it needs, or None to keep upstream's plan."""
    from accelerate.utils import compute_module_sizes, get_max_memory

    cores = device.device_count()
    if cores < 2:
        return None
    plan = get_max_memory()  # Neuron budgets (our patch) + host memory
    budgets = [int(plan.get(i, 0)) for i in range(cores)]
    model_bytes = int(compute_module_sizes(model)[""])
    k = cores_needed(model_bytes, budgets)
    if k is None or k == cores:
        return None
    if (model_bytes, k) not in _logged:
        _logged.add((model_bytes, k))
        logger.info(
            "accelerate_neuron: device_map='auto' places the model (%s) on %d of %d Neuron cores (0..%d): "
            "each core boundary costs a transfer and splits compiled graphs. "
            "Pass device_map='balanced' to spread it over every core.",
            format_size(model_bytes),
            k,
            cores,
            k - 1,
        )
    limited: dict[int | str, int] = {i: budgets[i] for i in range(k)}
    for key in ("cpu", "disk"):
        if key in plan:
            limited[key] = plan[key]
    return limited
