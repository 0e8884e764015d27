"""The one place that asks ``torch.neuron`` about cores and memory.

Only documented torch-neuronx API is used, and features are detected, not
versions: ``mem_get_info`` is used where a build has it, otherwise free memory
is ``total_memory - memory_reserved`` (early builds have no ``mem_get_info``).
Nothing here initialises the Neuron runtime unless the caller asks for memory
figures (``get_device_properties`` initialises it on the real backend too).
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("accelerate_neuron")

DEVICE_TYPE = "neuron"
Kind = Literal["real", "simulated"]


def _torch() -> Any:
    return sys.modules.get("torch")


def neuron_module() -> Any | None:
    """``torch.neuron`` if a Neuron backend (real or simulated) is registered."""
    torch = _torch()
    if torch is None:
        return None
    try:
        if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
            return None
    except Exception:
        return None
    return getattr(torch, DEVICE_TYPE, None)


def kind() -> Kind | None:
    """``"real"``, ``"simulated"`` or ``None`` (no Neuron device registered)."""
    module = neuron_module()
    if module is None:
        return None
    from .simulator import is_installed

    return "simulated" if is_installed() else "real"


def torch_neuronx_installed() -> bool:
    """Whether a ``torch_neuronx`` distribution is on the path (cheap: no import)."""
    try:
        return importlib.machinery.PathFinder.find_spec("torch_neuronx") is not None
    except Exception:
        return False


def is_available() -> bool:
    module = neuron_module()
    if module is None:
        return False
    try:
        return bool(module.is_available())
    except Exception as exc:
        logger.debug("torch.neuron.is_available() raised %s", exc)
        return False


def device_count() -> int:
    module = neuron_module()
    if module is None:
        return 0
    try:
        return int(module.device_count())
    except Exception as exc:
        logger.debug("torch.neuron.device_count() raised %s", exc)
        return 0


def is_neuron(device: Any) -> bool:
    """Whether ``device`` (str, int, torch.device) names a Neuron core."""
    torch = _torch()
    if torch is None or neuron_module() is None:
        return False
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return device >= 0  # torch >= 2.13: an integer index means the current accelerator
    try:
        return torch.device(device).type == DEVICE_TYPE
    except (TypeError, RuntimeError, ValueError):
        return False


@dataclass(frozen=True)
class CoreMemory:
    index: int
    total: int
    reserved: int
    allocated: int
    free: int
    source: str  # "mem_get_info" or "total_memory - memory_reserved"


def core_memory(index: int) -> CoreMemory:
    """Memory figures of visible core ``index`` (initialises the runtime)."""
    module = neuron_module()
    if module is None:
        raise RuntimeError("no Neuron device is registered in this process")
    total = int(module.get_device_properties(index).total_memory)
    reserved = int(module.memory_reserved(index))
    allocated = int(module.memory_allocated(index))
    mem_get_info = getattr(module, "mem_get_info", None)
    if callable(mem_get_info):
        free, total_info = mem_get_info(index)
        return CoreMemory(index, int(total_info), reserved, allocated, int(free), "mem_get_info")
    return CoreMemory(index, total, reserved, allocated, total - reserved, "total_memory - memory_reserved")
