"""One process per Neuron core: which core a rank uses, and the torch patches that enforce it.

ProcessGroupNeuron sets ``NEURON_RT_VISIBLE_CORES=$LOCAL_RANK`` only when the
variable is unset. When a launcher or the user exported a range for the whole
job (``accelerate launch --gpu_ids 0,1`` exports ``NEURON_RT_VISIBLE_CORES=0,1``
to every worker), every rank sees every core and upstream picks
``torch.neuron.current_device()``, i.e. core 0 for all ranks; on hardware the
runtimes of the ranks then claim the same cores. So, before the first process
group is created (the runtime must not be initialised yet), rank ``r`` narrows
the variable to the ``r``-th core of the job's list. Either way each process
sees exactly its own core, as device index 0.

A Ray worker is the exception (:mod:`.ray_workers`): Ray exported the worker's
own cores, not the job's, so its list is never narrowed by ``LOCAL_RANK``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ... import device, logs
from ...sizes import parse_core_list
from ..engines import ray_neuron_cores
from . import ray_workers

logger = logging.getLogger(__name__)

VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def local_rank() -> int | None:
    """``LOCAL_RANK`` set by torchrun / accelerate launch, or None outside a launcher."""
    return _int_env("LOCAL_RANK")


def core_for_rank(spec: str, rank: int, local_world_size: int | None) -> str | None:
    """The ``NEURON_RT_VISIBLE_CORES`` value rank ``rank`` should use, or None to leave ``spec`` alone.

    ``spec`` is the job-wide value. One core per process: rank ``r`` gets the
    ``r``-th listed core. A single-core list, or a single process per node,
    needs no narrowing.
    """
    cores = parse_core_list(spec)
    if len(cores) <= 1 or (local_world_size is not None and local_world_size <= 1):
        return None
    if rank >= len(cores):
        raise ValueError(
            f"{VISIBLE_CORES_ENV}={spec!r} lists {len(cores)} core(s) for this node, but local rank {rank} "
            f"needs one of its own (one process per Neuron core). List at least "
            f"{local_world_size or rank + 1} cores, or start fewer processes per node."
        )
    return str(cores[rank])


def narrow_visible_cores() -> str | None:
    """Give this rank its own core before the Neuron runtime starts; returns the new value if changed."""
    rank = local_rank()
    spec = os.environ.get(VISIBLE_CORES_ENV, "")
    if rank is None or rank < 0 or not spec.strip():
        return None
    if ray_neuron_cores() is not None:
        return None  # Ray exported this worker's own cores: nothing to narrow
    if device.runtime_initialized():
        return None  # too late to change what this process sees; the runtime would ignore it
    narrowed = core_for_rank(spec, rank, _int_env("LOCAL_WORLD_SIZE"))
    if narrowed is None:
        return None
    os.environ[VISIBLE_CORES_ENV] = narrowed
    logger.info(
        "accelerate_neuron: local rank %d uses Neuron core %s (%s=%r was set for the whole job)",
        rank,
        narrowed,
        VISIBLE_CORES_ENV,
        spec,
    )
    return narrowed


def local_core_index(rank: int | None = None) -> int:
    """The visible device index of this rank's core.

    After narrowing each process sees one core (index 0). If it still sees
    several (one process on the node, or the runtime started before the
    process group), rank ``r`` takes index ``r`` modulo the visible count.
    A Ray worker takes the first core Ray assigned it.
    """
    if rank is None:
        assigned = ray_neuron_cores()
        if assigned is not None:
            return ray_workers.core_index(assigned)
    rank = local_rank() if rank is None else rank
    count = device.device_count()
    if rank is None or rank < 0 or count <= 1:
        return 0
    return rank % count


def bind_local_core() -> int:
    """Make this rank's core the current Neuron device (initialises the runtime)."""
    index = local_core_index()
    if device.neuron_module() is not None:
        device.set_current_core(index)
    return index


def _is_neuron_backend(backend: Any) -> bool:
    if backend is None:
        try:
            import torch

            return torch._C._get_accelerator().type == device.DEVICE_TYPE
        except Exception:
            return False
    text = str(backend).lower()
    return text == "neuron" or "neuron:neuron" in text


def wrap_init_process_group(original: Any) -> Any:
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        backend = ray_workers.process_group_backend(backend)
        neuron = _is_neuron_backend(backend) and (local_rank() is not None or ray_neuron_cores() is not None)
        if neuron:
            narrow_visible_cores()
        result = original(backend, *args, **kwargs)
        if neuron:
            # Bind now: torch's DeviceMesh would otherwise call set_device(LOCAL_RANK),
            # an index this process (seeing only its own core) does not have.
            bind_local_core()
        return result

    return init_process_group


def _module_device(module: Any) -> Any:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def wrap_ddp_init(original: Any) -> Any:
    def __init__(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, *args: Any, **kwargs: Any):
        where = _module_device(module)
        if where is not None and where.type == device.DEVICE_TYPE and device_ids is not None and len(device_ids) == 1:
            import torch

            wanted = where.index if where.index is not None else 0
            given = device_ids[0]
            given_index = given.index if isinstance(given, torch.device) else given
            if given_index != wanted:
                logs.once(
                    logger,
                    "launch.ddp_device_ids",
                    "accelerate_neuron: DistributedDataParallel got device_ids=%s for a module on %s; "
                    "using the module's core (each process sees only its own Neuron core)",
                    list(device_ids),
                    where,
                    level=logging.INFO,
                )
                device_ids = [wanted]
                if output_device is not None:
                    output_device = wanted
        return original(self, module, device_ids, output_device, *args, **kwargs)

    return __init__
