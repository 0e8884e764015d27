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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

DEVICE_TYPE = "neuron"
Kind = Literal["real", "simulated"]
#: Attribute a stand-in device module sets to say it is not Neuron hardware.
SIMULATED_MARKER = "SIMULATED"


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
    return "simulated" if getattr(module, SIMULATED_MARKER, False) is True else "real"


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


def visible_cores() -> list[int]:
    """Indices of the Neuron cores this process sees (``0..device_count()-1``)."""
    return list(range(device_count()))


def current_core() -> int:
    """The core an index-less ``"neuron"`` means (``torch.neuron.current_device()``), 0 if unknown."""
    module = neuron_module()
    if module is None:
        return 0
    try:
        return int(module.current_device())
    except Exception as exc:
        logger.debug("torch.neuron.current_device() raised %s", exc)
        return 0


def core_index(device: Any) -> int | None:
    """The core index ``device`` names, or ``None`` if it does not name a Neuron core.

    Accepts what users and upstream put in a ``device_map``: ``3``, ``"neuron"``,
    ``"neuron:3"``, ``torch.device("neuron", 3)``. An index-less ``"neuron"``
    means the current core, as in torch. Whether the index is visible is not
    checked here. Negative ints are not Neuron cores (upstream uses -1 for CPU).
    """
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if device >= 0 and neuron_module() is not None else None
    torch = _torch()
    if torch is None or neuron_module() is None or not isinstance(device, (str, torch.device)):
        return None
    try:
        parsed = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        return None
    if parsed.type != DEVICE_TYPE:
        return None
    return current_core() if parsed.index is None else int(parsed.index)


def supports_bf16() -> bool:
    """Whether the Neuron device computes in bfloat16 (``torch.neuron.is_bf16_supported()``).

    Every NeuronCore generation torch-neuronx targets does; a build without the
    function is taken at its word that bf16 is the native training type.
    """
    module = neuron_module()
    if module is None or not is_available():
        return False
    probe = getattr(module, "is_bf16_supported", None)
    if not callable(probe):
        return True
    try:
        return bool(probe())
    except Exception as exc:
        logger.debug("torch.neuron.is_bf16_supported() raised %s", exc)
        return False


def set_current_core(index: int) -> None:
    """Make visible core ``index`` the current Neuron device (initialises the runtime)."""
    module = neuron_module()
    if module is None:
        raise RuntimeError("no Neuron device is registered in this process")
    module.set_device(index)


def runtime_initialized() -> bool:
    """Whether this process's Neuron runtime has started: from then on its visible cores are fixed."""
    module = neuron_module()
    if module is None:
        return False
    try:
        return bool(module.is_initialized())
    except Exception as exc:
        logger.debug("torch.neuron.is_initialized() raised %s", exc)
        return False


# --- a device registered after activation -----------------------------------------------------
# Whoever registers a Neuron device late (the simulator's install()) announces it here; the
# plugin side subscribes. Neither needs to import the other.

_listeners: list[Callable[[str], None]] = []
_listeners_lock = threading.Lock()


def on_registered(callback: Callable[[str], None]) -> None:
    """Call ``callback(source)`` whenever a Neuron device is announced as newly registered."""
    with _listeners_lock:
        if callback not in _listeners:
            _listeners.append(callback)


def announce_registered(source: str) -> None:
    """Tell the subscribers that a Neuron device was registered by ``source``; never raises."""
    with _listeners_lock:
        callbacks = list(_listeners)
    for callback in callbacks:
        try:
            callback(source)
        except Exception:
            logger.warning("accelerate_neuron: a device-registration listener failed", exc_info=True)
