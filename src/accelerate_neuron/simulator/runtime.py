"""State of the simulated Neuron runtime in this process.

Like the real runtime, the set of visible cores is read from
``NEURON_RT_VISIBLE_CORES`` / ``NEURON_RT_NUM_CORES`` when the runtime
initialises (first device allocation, ``init()``, ``set_device``,
``get_device_properties``), not at import: the ``"neuron"`` process group sets
``NEURON_RT_VISIBLE_CORES=$LOCAL_RANK`` after ``import torch`` and before any
device use. Until then ``device_count()`` follows the environment.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field

from ..sizes import parse_core_list


@dataclass
class SimState:
    lib: ctypes.CDLL
    total_cores: int
    hbm_bytes: int
    visible: list[int] = field(default_factory=list)
    frozen: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    def visible_cores_from_env(self) -> list[int]:
        """The physical core ids this process may use, from the environment."""
        env = os.environ
        cores = list(range(self.total_cores))
        spec = env.get("NEURON_RT_VISIBLE_CORES")
        if spec is not None and spec.strip() != "":
            cores = parse_core_list(spec, total=self.total_cores)
        num = env.get("NEURON_RT_NUM_CORES")
        if num is not None and num.strip() != "":
            if not num.strip().isdigit() or int(num) < 1:
                raise ValueError(f"invalid NEURON_RT_NUM_CORES={num!r}: expected a positive number of cores")
            if int(num) > len(cores):
                raise ValueError(
                    f"NEURON_RT_NUM_CORES={num} asks for more cores than the {len(cores)} visible ({cores})"
                )
            cores = cores[: int(num)]
        return cores

    def refresh(self) -> list[int]:
        """Re-read the environment unless the runtime already initialised."""
        with self.lock:
            if not self.frozen and not self.lib.nsim_is_initialized():
                self.visible = self.visible_cores_from_env()
                self.lib.nsim_configure(len(self.visible), self.hbm_bytes)
            return self.visible

    def initialise(self) -> None:
        """Initialise the runtime: from now on the visible cores are fixed."""
        with self.lock:
            if self.lib.nsim_in_bad_fork():
                raise RuntimeError(
                    "Cannot re-initialise the Neuron runtime in a forked subprocess "
                    "(simulated device). Start worker processes with the 'spawn' method."
                )
            self.refresh()
            self.frozen = True
            self.lib.nsim_mark_initialized()

    def is_initialized(self) -> bool:
        return bool(self.lib.nsim_is_initialized())

    def device_count(self) -> int:
        return len(self.refresh())


_state: SimState | None = None


def state() -> SimState:
    if _state is None:
        raise RuntimeError(
            "the simulated Neuron device is not installed: call "
            "accelerate_neuron.simulator.install() or set ACCELERATE_NEURON_SIMULATE=N"
        )
    return _state


def set_state(new: SimState) -> None:
    global _state
    _state = new


def get_state_or_none() -> SimState | None:
    return _state
