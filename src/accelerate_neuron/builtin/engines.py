"""What a distributed engine told this process, read by the built-in plugins: Ray's Neuron cores.

Ray knows Neuron cores as the resource ``neuron_cores`` and exports the cores it
assigned a worker in ``NEURON_RT_VISIBLE_CORES``. Ray Train then exports
``ACCELERATE_TORCH_DEVICE`` for Accelerate from its own device managers, which
know CUDA, HPU, NPU and TPU but not Neuron: a worker given Neuron cores is told
``cpu``. Accelerate's ``PartialState`` and the plugin's ``TrainingArguments``
defaults read that variable as the user's choice of device; it is not one.

Ray is recognised by what it sets, never by its version: a process Ray gave
Neuron cores is one whose ``ray.get_runtime_context().get_accelerator_ids()``
lists ``neuron_cores``. ``ray`` is always imported in a Ray worker; nothing here
imports it.
"""

from __future__ import annotations

import logging
import os
import sys

from .. import logs

logger = logging.getLogger(__name__)

#: Ray's resource name for Neuron cores (``ScalingConfig(resources_per_worker={"neuron_cores": 1})``).
RAY_RESOURCE = "neuron_cores"
#: The device Accelerate's ``PartialState`` takes as given; Ray Train exports it (``ray.train.torch.get_device()``).
TORCH_DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"


def ray_neuron_cores() -> list[str] | None:
    """The Neuron core ids Ray assigned this process, or None (not a Ray worker, or one without Neuron cores)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ids = ray.get_runtime_context().get_accelerator_ids().get(RAY_RESOURCE)
    except Exception as exc:  # a Ray that changed shape: behave as outside Ray
        logger.debug("ray.get_runtime_context().get_accelerator_ids() raised %s", exc)
        return None
    return [str(i) for i in ids] if ids else None


def forced_torch_device() -> str | None:
    """``ACCELERATE_TORCH_DEVICE`` as a choice of device: None when unset, or when it is the CPU Ray Train
    exported for a worker it gave Neuron cores."""
    exported = os.environ.get(TORCH_DEVICE_ENV, "").strip()
    if not exported:
        return None
    if exported.split(":")[0].lower() != "cpu":
        return exported
    cores = ray_neuron_cores()
    if cores is None:
        return exported
    logs.once(
        logger,
        "engines.ray_torch_device",
        "accelerate_neuron: Ray Train exported %s=%s for a worker it gave Neuron core(s) %s "
        "(Ray's device managers do not know Neuron); training on the Neuron core instead",
        TORCH_DEVICE_ENV,
        exported,
        ",".join(cores),
        level=logging.INFO,
    )
    return None
