"""Ray counts the simulated cores as ``neuron_cores``, as it counts a Trainium host's.

Ray's ``NeuronAcceleratorManager`` (``ray/_private/accelerators/neuron.py``) finds
a node's Neuron cores by running ``/opt/aws/neuron/bin/neuron-ls --json-output``
and adding up ``nc_count``; it exports the cores it assigns a worker in
``NEURON_RT_VISIBLE_CORES`` (comma-separated ids). A host with the simulator has
no ``neuron-ls``, so ``ray.init()`` would register no ``neuron_cores`` and a
``ScalingConfig(resources_per_worker={"neuron_cores": 1})`` would wait for cores
forever. While the simulated device is installed, a node whose ``neuron-ls``
found nothing counts the simulated cores instead, in the process that resolves
the node's resources (the driver of ``ray.init()``, once torch is imported).
``ray start`` does not import torch: give it ``--resources='{"neuron_cores": N}'``.
"""

from __future__ import annotations

from typing import Any

from ..patching import Patch, apply

MODULE = "ray._private.accelerators.neuron"


def _wrap(original: Any) -> Any:
    def get_current_node_num_accelerators() -> int:
        found = original()
        if found:
            return found  # neuron-ls answered: a real device, never shadowed
        from .runtime import get_state_or_none

        state = get_state_or_none()
        return state.total_cores if state is not None else 0

    return get_current_node_num_accelerators


PATCH = Patch(
    MODULE,
    "NeuronAcceleratorManager.get_current_node_num_accelerators",
    _wrap,
    reason="ray.init() registers the simulated cores as the node's neuron_cores",
    lacking="every Ray release (cores are found with neuron-ls only)",
)


def register(_module: object = None) -> None:
    """Apply :data:`PATCH` (when Ray's Neuron accelerator manager is imported)."""
    apply(PATCH, plugin="simulator")
