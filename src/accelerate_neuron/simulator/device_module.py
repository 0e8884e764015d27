"""``torch.neuron`` of the simulated device: the API of torch-neuronx's device module.

Kept to the functions the real module documents (torch-neuronx 2.13/2.14), with its gaps:
by default there is no ``mem_get_info`` (torch-neuronx 2.33 builds lack it; free
memory is ``total_memory - memory_reserved``). ``ACCELERATE_NEURON_SIM_MEM_GET_INFO=1``
adds it, as newer SDKs have it (Neuron 2.34's release notes: the ``torch.accelerator``
memory functions work), so that code meant for both can be tested against both.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import settings
from .backend_api import get_dynamo_metrics, reset_dynamo_metrics
from .runtime import state

__all__ = [
    "Event",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_name",
    "get_device_properties",
    "get_dynamo_metrics",
    "get_rng_state",
    "get_rng_state_all",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_dynamo_metrics",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_rng_state",
    "set_rng_state_all",
    "stream",
    "synchronize",
]

DeviceLike = int | str | torch.device | None

#: ``accelerate_neuron.device.kind()`` reads this: "simulated", not Neuron hardware.
SIMULATED = True

_DEVICE_NAME = "NeuronCore-v3 (simulated)"


@dataclass(frozen=True)
class NeuronDeviceProperties:
    name: str
    total_memory: int
    physical_core: int

    def __repr__(self) -> str:
        gib = self.total_memory / 2**30
        return (
            f"NeuronDeviceProperties(name='{self.name}', total_memory={gib:.0f}GiB, physical_core={self.physical_core})"
        )


def _index(device: DeviceLike = None, *, optional: bool = True) -> int:
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"expected a neuron device, got {device!r}")
        if device.index is None:
            return current_device()
        device = device.index
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"expected a neuron device index, str or torch.device, got {device!r}")
    count = device_count()
    if not 0 <= device < count:
        raise ValueError(
            f"invalid neuron device index {device}: {count} core(s) visible "
            f"(valid 0..{count - 1}; NEURON_RT_VISIBLE_CORES selects cores)"
        )
    return device


# ------------------------------------------------------------------ device


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return state().device_count()


def is_initialized() -> bool:
    return state().is_initialized()


def init() -> None:
    state().initialise()


def _lazy_init() -> None:
    # Called by PyTorch before the first tensor is created on the device.
    state().initialise()


def _is_in_bad_fork() -> bool:
    return bool(state().lib.nsim_in_bad_fork())


def current_device() -> int:
    return int(state().lib.nsim_current_device())


def set_device(device: DeviceLike) -> None:
    index = _index(device)
    state().initialise()
    state().lib.nsim_set_device(index)


class device:
    """Context manager that makes ``device`` the current Neuron core."""

    def __init__(self, device: DeviceLike) -> None:
        self.idx = -1 if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = current_device()
        if self.idx >= 0:
            state().lib.nsim_set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            state().lib.nsim_set_device(self.prev_idx)


def get_device_properties(device: DeviceLike = None) -> NeuronDeviceProperties:
    index = _index(device)
    st = state()
    st.initialise()
    return NeuronDeviceProperties(_DEVICE_NAME, st.hbm_bytes, st.visible[index])


def get_device_name(device: DeviceLike = None) -> str:
    return get_device_properties(device).name


def synchronize(device: DeviceLike = None) -> None:
    # Simulated work is synchronous; validating the device is all there is.
    _index(device)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


# ------------------------------------------------------------------ memory


def memory_allocated(device: DeviceLike = None) -> int:
    return int(state().lib.nsim_memory(_index(device), 0))


def max_memory_allocated(device: DeviceLike = None) -> int:
    return int(state().lib.nsim_memory(_index(device), 1))


def memory_reserved(device: DeviceLike = None) -> int:
    # No caching allocator is modelled: what is reserved is what is allocated.
    return memory_allocated(device)


def max_memory_reserved(device: DeviceLike = None) -> int:
    return max_memory_allocated(device)


MEM_GET_INFO_ENV = settings.env_name("sim_mem_get_info")


def _mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of a core, like ``torch.cuda.mem_get_info`` (offered by newer SDKs only)."""
    index = _index(device)
    st = state()
    st.initialise()
    return st.hbm_bytes - memory_reserved(index), st.hbm_bytes


def offer_mem_get_info(enabled: bool) -> None:
    """Add (or remove) ``torch.neuron.mem_get_info``, as a newer (or older) SDK would have it."""
    module = globals()
    if enabled:
        module["mem_get_info"] = _mem_get_info
    else:
        module.pop("mem_get_info", None)


def mem_get_info_from_env() -> bool:
    """The ``sim_mem_get_info`` setting: whether ``torch.neuron.mem_get_info`` exists."""
    return settings.get("sim_mem_get_info")


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    state().lib.nsim_reset_peak(_index(device))


def empty_cache() -> None:
    """Nothing is cached by the simulated allocator."""


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    index = _index(device)
    lib = state().lib
    allocated, peak = int(lib.nsim_memory(index, 0)), int(lib.nsim_memory(index, 1))
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": allocated,
        "reserved_bytes.all.peak": peak,
        "allocation.all.allocated": int(lib.nsim_memory(index, 3)),
        "allocation.all.freed": int(lib.nsim_memory(index, 4)),
        "num_ooms": int(lib.nsim_memory(index, 5)),
        "num_alloc_retries": 0,
    }


# ------------------------------------------------------------------ RNG


def manual_seed(seed: int) -> None:
    state().lib.nsim_manual_seed(current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    # torch.manual_seed() calls this: it must not call torch.manual_seed back.
    st = state()
    for index in range(max(st.device_count(), 1)):
        st.lib.nsim_manual_seed(index, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def seed() -> None:
    state().lib.nsim_seed(current_device())


def seed_all() -> None:
    st = state()
    first = st.lib.nsim_seed(0)
    for index in range(1, st.device_count()):
        st.lib.nsim_manual_seed(index, first)


def initial_seed() -> int:
    return int(state().lib.nsim_initial_seed(current_device()))


def get_rng_state(device: DeviceLike = "neuron") -> torch.Tensor:
    index = _index(device)
    lib = state().lib
    size = lib.nsim_get_rng_state(index, None, 0)
    out = torch.empty(size, dtype=torch.uint8)
    lib.nsim_get_rng_state(index, ctypes.c_void_p(out.data_ptr()), size)
    return out


def set_rng_state(new_state: torch.Tensor, device: DeviceLike = "neuron") -> None:
    index = _index(device)
    data = new_state.detach().to("cpu", torch.uint8).contiguous()
    state().lib.nsim_set_rng_state(index, ctypes.c_void_p(data.data_ptr()), data.numel())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, new_state in enumerate(new_states):
        set_rng_state(new_state, index)


# ------------------------------------------------------------------ streams


class _OnNeuron(type):
    """``isinstance(x, torch.neuron.Event)``: a torch.Event/Stream on a neuron device.

    Instances are plain ``torch.Stream`` / ``torch.Event`` objects: PyTorch's
    C++ checks (e.g. ``Event.elapsed_time``) accept only those exact types.
    """

    _base: type

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls._base) and getattr(obj, "device", None) is not None and obj.device.type == "neuron"


class Stream(metaclass=_OnNeuron):
    """A Neuron stream; work in the simulator completes when it is queued."""

    _base = torch.Stream

    def __new__(cls, device: DeviceLike = None, priority: int = 0) -> torch.Stream:  # type: ignore[misc]
        return torch.Stream(device=torch.device("neuron", _index(device)), priority=priority)


class Event(metaclass=_OnNeuron):
    """A Neuron event (host timestamps in the simulator)."""

    _base = torch.Event

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # type: ignore[misc]
        return torch.Event(device=torch.device("neuron", current_device()), enable_timing=enable_timing)


def current_stream(device: DeviceLike = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("neuron", _index(device)))


def default_stream(device: DeviceLike = None) -> torch.Stream:
    return current_stream(device)


@contextmanager
def stream(s: torch.Stream | None) -> Iterator[None]:
    """Run the block on stream ``s`` (a no-op in the simulator: one stream per core)."""
    yield
