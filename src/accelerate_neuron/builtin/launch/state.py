"""Accelerate's runtime on Neuron: device choice per rank, and the MULTI_NEURON backfill.

All releases: ``PartialState.set_device`` binds the rank's own core (1.15 reads
``torch.neuron.current_device()``, which is core 0 in every rank when the job
sees several cores) and ``wait_for_everyone`` names that core in its barrier
(upstream passes the local rank as a device index, which a process that sees
only its own core does not have). In a Ray Train worker given Neuron cores,
the ``ACCELERATE_TORCH_DEVICE=cpu`` Ray exported is not the device
(:func:`..engines.forced_torch_device`).

Accelerate <= 1.12 (no ``MULTI_NEURON``): the backend choice, the default
device, DDP wrapping (``multi_device``), reduce/gather, bf16 autocast and RNG
synchronisation get the branches 1.13+ has. Each such patch is skipped when
upstream defines ``DistributedType.MULTI_NEURON`` itself: those releases ship
all of these branches together.
"""

from __future__ import annotations

import os
from typing import Any

from ... import device
from ..engines import TORCH_DEVICE_ENV, forced_torch_device
from ..enum_backfill import has_native_member
from .cores import bind_local_core, local_rank

MULTI_NEURON = "MULTI_NEURON"
LACKING_OLD = "accelerate <= 1.12 (no DistributedType.MULTI_NEURON)"


def distributed_type(name: str) -> Any:
    """``DistributedType(name)``: works for upstream and backfilled members alike."""
    from accelerate.utils.dataclasses import DistributedType

    return DistributedType(name)


def upstream_has_multi_neuron(_original: Any = None) -> str | None:
    """``needed`` probe: None (patch needed) unless upstream defines MULTI_NEURON."""
    from accelerate.utils.dataclasses import DistributedType

    if has_native_member(DistributedType, MULTI_NEURON):
        return "upstream defines DistributedType.MULTI_NEURON and its branches"
    return None


# ------------------------------------------------------------------ all releases


def wrap_set_device(original: Any) -> Any:
    def set_device(self: Any) -> None:
        if self.distributed_type == MULTI_NEURON and (self.device is None or _not_chosen(self.device)):
            import torch

            self.device = torch.device(device.DEVICE_TYPE, bind_local_core())
            return
        original(self)

    return set_device


def _not_chosen(chosen: Any) -> bool:
    """Whether ``chosen`` came from an ACCELERATE_TORCH_DEVICE that is no choice (Ray Train's CPU fallback)."""
    return chosen.type == "cpu" and TORCH_DEVICE_ENV in os.environ and forced_torch_device() is None


def wrap_wait_for_everyone(original: Any) -> Any:
    def wait_for_everyone(self: Any) -> None:
        if self.distributed_type == MULTI_NEURON:
            import torch

            index = self.device.index if self.device is not None and self.device.index is not None else 0
            torch.distributed.barrier(device_ids=[index])
            return
        original(self)

    return wait_for_everyone


# ------------------------------------------------------------------ accelerate <= 1.12


def wrap_prepare_backend(original: Any) -> Any:
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, dist_type = original(self, cpu, sagemaker_dp, backend)
        rank = local_rank()
        if (
            not cpu
            and not sagemaker_dp
            and rank is not None
            and rank != -1
            and dist_type == "MULTI_CPU"
            and device.is_available()
        ):
            # Upstream found no accelerator it knows and fell back to CPU + gloo.
            return "neuron", distributed_type(MULTI_NEURON)
        return chosen, dist_type

    return _prepare_backend


def wrap_default_device(original: property) -> property:
    def default_device(self: Any) -> Any:
        chosen = original.fget(self)
        if chosen.type == "cpu" and device.is_available():
            import torch

            return torch.device(device.DEVICE_TYPE)
        return chosen

    return property(default_device, doc=original.__doc__)


def wrap_multi_device(original: property) -> property:
    def multi_device(self: Any) -> bool:
        return bool(original.fget(self)) or (self.use_distributed and self.distributed_type == MULTI_NEURON)

    return property(multi_device, doc=original.__doc__)


def add_multi_neuron(original: list) -> list:
    return [*original, MULTI_NEURON]


def lists_multi_neuron(original: list) -> str | None:
    return "upstream lists MULTI_NEURON" if MULTI_NEURON in original else None


def wrap_autocast(original: Any) -> Any:
    def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        if native_amp and state.distributed_type == MULTI_NEURON and state.mixed_precision in ("bf16", "fp8"):
            import torch

            kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
            return torch.autocast(device_type=state.device.type, dtype=torch.bfloat16, **kwargs)
        return original(native_amp, autocast_kwargs)

    return get_mixed_precision_context_manager


def wrap_synchronize_rng_state(original: Any) -> Any:
    def synchronize_rng_state(rng_type: Any = None, generator: Any = None) -> Any:
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        kind = getattr(rng_type, "value", rng_type)
        if state.distributed_type != MULTI_NEURON or kind not in ("torch", "generator"):
            return original(rng_type, generator)
        import torch

        if kind == "generator":
            if generator is None:
                raise ValueError("Need a generator to synchronize its seed.")
            rng_state = generator.get_state()
        else:
            rng_state = torch.get_rng_state()
        # Same as upstream's GPU branch: broadcast rank 0's state through the device.
        rng_state = rng_state.to(state.device)
        torch.distributed.broadcast(rng_state, 0)
        rng_state = rng_state.cpu()
        if kind == "generator":
            generator.set_state(rng_state)
        else:
            torch.set_rng_state(rng_state)
        return None

    return synchronize_rng_state
