"""Ray Train workers on Neuron: the core Ray assigned, and the process group Ray creates.

Ray Train sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``) and creates the process group itself before the user's
function runs: ``gloo`` without GPUs (``TorchConfig()``'s default), or
``TorchConfig(backend=...)``. In a worker Ray gave Neuron cores
(:func:`..engines.ray_neuron_cores`):

- ``NEURON_RT_VISIBLE_CORES`` is this worker's own list, not the job's, so it is
  never narrowed by ``LOCAL_RANK`` (:mod:`.cores`); the worker binds the first
  core Ray assigned it;
- a ``gloo`` world group becomes ``cpu:gloo,neuron:neuron``: CPU tensors still go
  through gloo, Neuron tensors through the Neuron backend (DDP's gradients).

And on a host with the simulated device, Ray counts its cores as ``neuron_cores``:
Ray's ``NeuronAcceleratorManager`` finds a node's cores by running
``/opt/aws/neuron/bin/neuron-ls --json-output`` only, so ``ray.init()`` there
registered none and a ``ScalingConfig`` asking for them waited forever. It is
counted in the process that starts the node (``ray.init()`` in a script that
imported torch); ``ray start`` imports no torch.

The ``ACCELERATE_TORCH_DEVICE=cpu`` Ray Train exports is handled where it is read
(:func:`..engines.forced_torch_device`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ... import device, logs
from ...sizes import parse_core_list
from ..engines import ray_neuron_cores

logger = logging.getLogger(__name__)

VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"


def core_index(assigned: list[str]) -> int:
    """The visible index of the first core Ray assigned (0 when Ray exported the worker's own list)."""
    spec = os.environ.get(VISIBLE_CORES_ENV, "").strip()
    if not spec:
        # Ray was told not to export the variable (RAY_EXPERIMENTAL_NOSET_NEURON_RT_VISIBLE_CORES):
        # every core is visible and Ray's id is the index.
        return int(assigned[0]) if assigned[0].isdigit() else 0
    try:
        visible = [str(c) for c in parse_core_list(spec)]
    except ValueError:
        return 0
    if assigned[0] in visible:
        return visible.index(assigned[0])
    logs.once(
        logger,
        "launch.ray_cores_overridden",
        "accelerate_neuron: Ray assigned Neuron core(s) %s to this worker but %s=%r does not list them; "
        "using the first visible core",
        assigned,
        VISIBLE_CORES_ENV,
        spec,
    )
    return 0


def _neuron_backend_registered() -> bool:
    try:
        import torch.distributed as dist

        return device.DEVICE_TYPE in dist.Backend.backend_list
    except Exception:
        return False


def process_group_backend(backend: Any) -> Any:
    """The backend a Ray worker given Neuron cores should create its group with: ``gloo`` gains ``neuron:neuron``.

    Ray Train asks for ``gloo`` when no GPU was requested. A ``gloo`` group cannot
    run collectives on Neuron tensors (DDP's gradient all-reduce); the mixed
    backend keeps CPU collectives on gloo and sends Neuron tensors to the Neuron
    backend. Any other backend (``TorchConfig(backend="neuron")``, a mixed string
    the user wrote) is left as it is.
    """
    if not isinstance(backend, str) or backend.strip().lower() != "gloo":
        return backend
    if device.neuron_module() is None or not _neuron_backend_registered():
        return backend
    assigned = ray_neuron_cores()
    if assigned is None:
        return backend
    mixed = f"cpu:gloo,{device.DEVICE_TYPE}:{device.DEVICE_TYPE}"
    logs.once(
        logger,
        "launch.ray_gloo",
        "accelerate_neuron: Ray asked for a gloo process group in a worker it gave Neuron core(s) %s; "
        "creating it as %r (collectives on Neuron tensors need the Neuron backend)",
        assigned,
        mixed,
        level=logging.INFO,
    )
    return mixed


def simulated_device_only(_original: Any = None) -> str | None:
    """``needed`` probe: Ray's own count stands on a host with real Neuron cores (neuron-ls answers there)."""
    if device.kind() != "simulated":
        return "no simulated Neuron device: Ray counts real cores with neuron-ls"
    return None


def wrap_node_core_count(original: Any) -> Any:
    def get_current_node_num_accelerators() -> int:
        found = original()
        if found or device.kind() != "simulated":
            return found  # neuron-ls answered: a real device, never shadowed
        return device.device_count()

    return get_current_node_num_accelerators
