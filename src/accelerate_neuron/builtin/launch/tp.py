"""Transformers tensor parallelism / ``DistributedConfig`` under torchrun on Neuron.

Transformers 5.x binds the local device with
``torch.accelerator.set_device_index(LOCAL_RANK)`` before
``init_process_group``: that initialises the Neuron runtime too early
(ProcessGroupNeuron refuses to start) and names core ``LOCAL_RANK``, which a
process that sees only its own core does not have. Transformers 4.57's
``tp_plan="auto"`` path has no ``neuron`` entry in its backend map and calls
``set_device(LOCAL_RANK)`` the same way.
"""

from __future__ import annotations

import os
from typing import Any

from ... import device
from .cores import bind_local_core, narrow_visible_cores


def wrap_bind_local_device(original: Any) -> Any:
    def _bind_local_device(device_type: str, local_rank: int) -> Any:
        if device_type != device.DEVICE_TYPE:
            return original(device_type, local_rank)
        import torch

        if not torch.distributed.is_initialized():
            # Called before init_process_group: leave the device untouched (the
            # "neuron" process group must start first; it binds the core). Once it
            # exists, a launched process sees only its own core: index 0.
            narrow_visible_cores()
            return torch.device(device_type, 0)
        return torch.device(device_type, bind_local_core())

    return _bind_local_device


def wrap_initialize_tensor_parallelism(original: Any) -> Any:
    def initialize_tensor_parallelism(tp_plan: Any, tp_size: Any = None) -> Any:
        import torch

        if tp_plan is None or torch._C._get_accelerator().type != device.DEVICE_TYPE:
            return original(tp_plan, tp_size)
        if not torch.distributed.is_initialized():
            try:
                torch.distributed.init_process_group(
                    backend="neuron", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
                )
            except Exception as exc:
                raise OSError(
                    "We tried to initialize torch.distributed for you, but it failed. Make "
                    "sure you init torch distributed in your script to use `tp_plan='auto'`."
                ) from exc
        tp_device = torch.device(device.DEVICE_TYPE, bind_local_core())
        tp_size = tp_size if tp_size is not None else torch.distributed.get_world_size()
        device_mesh = torch.distributed.init_device_mesh(tp_device.type, (tp_size,))
        return tp_device, tp_device, device_mesh, tp_size

    return initialize_tensor_parallelism


def binds_through_bind_local_device(original: Any) -> str | None:
    if getattr(original, "__module__", "") != "transformers.integrations.tensor_parallel":
        return "upstream binds the device through transformers.distributed.utils._bind_local_device (patched)"
    return None
