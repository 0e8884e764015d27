"""Accelerate's runtime on Neuron: device choice per rank, and the MULTI_NEURON backfill.

All releases: ``PartialState.set_device`` binds the rank's own core (1.15 reads
``torch.neuron.current_device()``, which is core 0 in every rank when the job
sees several cores) and ``wait_for_everyone`` names that core in its barrier
(upstream passes the local rank as a device index, which a process that sees
only its own core does not have).

Accelerate <= 1.12 (no ``MULTI_NEURON``): the backend choice, the default
device, DDP wrapping (``multi_device``), reduce/gather, bf16 autocast and RNG
synchronisation get the branches 1.13+ has. Each such patch is skipped when
upstream defines ``DistributedType.MULTI_NEURON`` itself: those releases ship
all of these branches together.
"""

from __future__ import annotations

from typing import Any

from .. import device
from ..patching import Patch
from ._enum_backfill import has_native_member
from ._launch_cores import bind_local_core, local_rank

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


def _wrap_set_device(original: Any) -> Any:
    def set_device(self: Any) -> None:
        if self.device is None and self.distributed_type == MULTI_NEURON:
            import torch

            self.device = torch.device(device.DEVICE_TYPE, bind_local_core())
            return
        original(self)

    return set_device


def _wrap_wait_for_everyone(original: Any) -> Any:
    def wait_for_everyone(self: Any) -> None:
        if self.distributed_type == MULTI_NEURON:
            import torch

            index = self.device.index if self.device is not None and self.device.index is not None else 0
            torch.distributed.barrier(device_ids=[index])
            return
        original(self)

    return wait_for_everyone


# ------------------------------------------------------------------ accelerate <= 1.12


def _wrap_prepare_backend(original: Any) -> Any:
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


def _wrap_default_device(original: property) -> property:
    def default_device(self: Any) -> Any:
        chosen = original.fget(self)
        if chosen.type == "cpu" and device.is_available():
            import torch

            return torch.device(device.DEVICE_TYPE)
        return chosen

    return property(default_device, doc=original.__doc__)


def _wrap_multi_device(original: property) -> property:
    def multi_device(self: Any) -> bool:
        return bool(original.fget(self)) or (self.use_distributed and self.distributed_type == MULTI_NEURON)

    return property(multi_device, doc=original.__doc__)


def _add_multi_neuron(original: list) -> list:
    return [*original, MULTI_NEURON]


def _lists_multi_neuron(original: list) -> str | None:
    return "upstream lists MULTI_NEURON" if MULTI_NEURON in original else None


def _wrap_autocast(original: Any) -> Any:
    def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        if native_amp and state.distributed_type == MULTI_NEURON and state.mixed_precision in ("bf16", "fp8"):
            import torch

            kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
            return torch.autocast(device_type=state.device.type, dtype=torch.bfloat16, **kwargs)
        return original(native_amp, autocast_kwargs)

    return get_mixed_precision_context_manager


def _wrap_synchronize_rng_state(original: Any) -> Any:
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


def patches() -> list[Patch]:
    state, accel, utils = "accelerate.state", "accelerate.accelerator", "accelerate.utils"
    return [
        Patch(
            state,
            "PartialState.set_device",
            _wrap_set_device,
            reason="rank r trains on its own Neuron core",
            lacking="accelerate 1.15 (torch.neuron.current_device(): core 0 for every rank when the job sees "
            "several cores); accelerate <= 1.12 (no neuron branch)",
            params=("self",),
        ),
        Patch(
            state,
            "PartialState.wait_for_everyone",
            _wrap_wait_for_everyone,
            reason="the barrier must name this process's core, not its local rank",
            lacking="accelerate (barrier(device_ids=[local_process_index])); <= 1.12: no barrier for MULTI_NEURON",
            params=("self",),
        ),
        Patch(
            state,
            "PartialState._prepare_backend",
            _wrap_prepare_backend,
            reason="under torchrun / accelerate launch, Neuron ranks use the 'neuron' process group (MULTI_NEURON)",
            lacking=LACKING_OLD + ": MULTI_CPU + gloo on a Neuron host",
            params=("cpu", "sagemaker_dp", "backend"),
            needed=upstream_has_multi_neuron,
        ),
        Patch(
            state,
            "PartialState.default_device",
            _wrap_default_device,
            reason="a single process uses the Neuron device",
            lacking=LACKING_OLD + ": cpu",
            needed=upstream_has_multi_neuron,
        ),
        Patch(
            accel,
            "Accelerator.multi_device",
            _wrap_multi_device,
            reason="prepare_model wraps the model in DDP (gradients all-reduced) under MULTI_NEURON",
            lacking=LACKING_OLD,
            needed=upstream_has_multi_neuron,
        ),
        Patch(
            f"{utils}.constants",
            "TORCH_DISTRIBUTED_OPERATION_TYPES",
            _add_multi_neuron,
            reason="accelerator.gather / reduce / broadcast / pad_across_processes use torch.distributed",
            lacking=LACKING_OLD,
            aliases=(
                f"{utils}.operations.TORCH_DISTRIBUTED_OPERATION_TYPES",
                f"{utils}.TORCH_DISTRIBUTED_OPERATION_TYPES",
            ),
            needed=_lists_multi_neuron,
        ),
        Patch(
            f"{utils}.modeling",
            "get_mixed_precision_context_manager",
            _wrap_autocast,
            reason="bf16 mixed precision autocasts to bfloat16 under MULTI_NEURON",
            lacking=LACKING_OLD + " (autocast without dtype, i.e. the device default)",
            params=("native_amp", "autocast_kwargs"),
            aliases=(f"{utils}.get_mixed_precision_context_manager", f"{accel}.get_mixed_precision_context_manager"),
            needed=upstream_has_multi_neuron,
        ),
        Patch(
            f"{utils}.random",
            "synchronize_rng_state",
            _wrap_synchronize_rng_state,
            reason="ranks shuffle data identically (rank 0's RNG state broadcast)",
            lacking=LACKING_OLD + ": no synchronisation",
            params=("rng_type", "generator"),
            aliases=(f"{utils}.synchronize_rng_state",),
            needed=upstream_has_multi_neuron,
        ),
    ]
