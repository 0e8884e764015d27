"""The simulated ``"neuron"`` c10d backend.

Collectives run through gloo on zero-copy CPU aliases of the device tensors,
so results land in device memory as on hardware. What is modelled from the
real ProcessGroupNeuron: it is registered for ``devices=["neuron"]``; creating
the first (world) group sets ``NEURON_RT_VISIBLE_CORES=$LOCAL_RANK`` when unset
(one core per process), and refuses to start when this process already
initialised the Neuron runtime (touching the device before
``init_process_group`` breaks a torchrun job on Trainium); subgroups
(``new_group``, DeviceMesh dimensions) come later and are not affected; a
barrier on a core the process does not see is an error.

The group is a Python ``ProcessGroup`` (c10d has no Python ``Backend``), so it
implements every collective name torch calls on a group, and registers its
gloo backend for ``neuron`` so that functional collectives (DTensor,
DeviceMesh, FSDP2) find the group by name.

Not modelled: collective performance, and the physical sharing of cores
between processes (each process simulates its own cores).

Gloo sees host aliases made in Python, which the real C++ group never makes:
:class:`_HeldAliases` holds a C++ reference to each until gloo has let go of
it, so that no gloo thread ever takes the GIL (see there).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

import torch

from .runtime import state

logger = logging.getLogger(__name__)

BACKEND_NAME = "neuron"


class RuntimeAlreadyInitializedError(RuntimeError):
    """The Neuron runtime was initialised before the "neuron" process group."""


def _host(obj: Any, made: list[torch.Tensor]) -> Any:
    """Replace neuron tensors (also inside lists) by CPU aliases of their memory, appending those to ``made``."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "neuron":
            return obj
        alias = torch.ops.neuron_sim.cpu_alias(obj)
        made.append(alias)
        return alias
    if isinstance(obj, list):
        return [_host(o, made) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_host(o, made) for o in obj)
    return obj


class _HeldAliases:
    """The host aliases of collectives in flight, held until gloo has let go of them.

    An alias is a tensor made in Python, so it has a Python object, and PyTorch
    takes the GIL whenever such a tensor's C++ reference count falls back to one
    (``c10/util/intrusive_ptr.h``, "PyObject preservation"). Left alone, that is
    the gloo thread freeing the finished work; if the interpreter starts
    finalizing while that thread waits for the GIL, CPython ends the thread inside
    the destructor and the process aborts with "terminate called without an
    active exception" (a 2-rank launch did, under load, in
    ``AsyncAllgatherWork::~AsyncAllgatherWork``). So each alias gets a C++
    reference of ours (``neuron_sim::hold``) before gloo sees it; gloo's release
    then never brings the count to one, and ours is dropped by a thread that runs
    Python anyway: the next collective's, or the main thread at exit. The real
    ProcessGroupNeuron is C++ and makes no such objects. A held alias keeps its
    device memory allocated, so each collective first drops the aliases only we
    still use.
    """

    # Without Tensor._use_count (private; torch 2.13 has it) nothing could tell when gloo let go:
    # gloo's thread then frees the aliases itself, as before.
    enabled = hasattr(torch.Tensor, "_use_count")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def hold(self, aliases: list[torch.Tensor]) -> list[torch.Tensor]:
        """Our C++ references to ``aliases``: take them before gloo sees the aliases, then :meth:`add` both."""
        return [torch.ops.neuron_sim.hold(a) for a in aliases] if self.enabled else []

    def add(self, aliases: list[torch.Tensor], holds: list[torch.Tensor]) -> None:
        released = self.release_unused()
        if holds:
            with self._lock:
                self._held.append((aliases, holds))
        del released  # freed here, outside the lock

    def release_unused(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Stop holding the aliases that only this list still uses; return them for the caller to drop."""
        kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        released: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        with self._lock:
            for entry in self._held:
                # 2: the alias's Python object and our hold; more while gloo (or a future) has it.
                (released if all(t._use_count() == 2 for t in entry[0]) else kept).append(entry)
            self._held = kept
        return released

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


# One for the process: a group's aliases may outlive the group (a work or future held past
# destroy_process_group), and must still not be dropped while gloo holds them.
held_aliases = _HeldAliases()


def _chunks(whole: torch.Tensor, part: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """``whole`` (flat or stacked, ``world_size`` x ``part``) as per-rank views shaped like ``part``."""
    if whole.numel() != part.numel() * world_size:
        raise ValueError(
            f"collective output/input of {whole.numel()} elements must hold world_size={world_size} "
            f"chunks of the {tuple(part.shape)} tensor ({part.numel() * world_size} elements)"
        )
    return list(whole.reshape(world_size, *part.shape).unbind(0))


class NeuronProcessGroup(torch.distributed.ProcessGroup):
    """ProcessGroup for ``backend="neuron"`` on the simulated device."""

    def __init__(self, rank: int, world_size: int, inner: Any) -> None:
        super().__init__(rank, world_size)
        self._inner = inner

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(BACKEND_NAME)]

    def _call(self, name: str, *args: Any) -> Any:
        made: list[torch.Tensor] = []
        with torch.no_grad():
            host_args = [_host(a, made) for a in args]
            holds = held_aliases.hold(made)
            work = getattr(self._inner, name)(*host_args)
        held_aliases.add(made, holds)
        return work

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.AllreduceOptions()
        return self._call("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.AllreduceCoalescedOptions()
        return self._call("allreduce_coalesced", tensors, opts)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.BroadcastOptions()
        return self._call("broadcast", tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.AllgatherOptions()
        return self._call("allgather", output_tensors, input_tensors, opts)

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else torch.distributed.AllgatherOptions()
        # As ProcessGroupNCCL: the output (flat or stacked) is world_size chunks shaped like the
        # input; gloo's _allgather_base wants them shaped like that already, so use its list form.
        return self._call("allgather", [_chunks(output, input, self.size())], [input], opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.ReduceScatterOptions()
        return self._call("reduce_scatter", output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else torch.distributed.ReduceScatterOptions()
        return self._call("reduce_scatter", [output], [_chunks(input, output, self.size())], opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.ReduceOptions()
        return self._call("reduce", tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.GatherOptions()
        return self._call("gather", output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.ScatterOptions()
        return self._call("scatter", output_tensors, input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else torch.distributed.AllToAllOptions()
        return self._call("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else torch.distributed.AllToAllOptions()
        return self._call("alltoall", output_tensors, input_tensors, opts)

    def barrier(self, opts=None):
        opts = opts if opts is not None else torch.distributed.BarrierOptions()
        device = getattr(opts, "device", None)
        if device is not None and device.type == BACKEND_NAME:
            # Like ProcessGroupNCCL, the barrier runs a collective on a tensor on
            # opts.device: a core this process does not see is an error.
            from .device_module import _index

            _index(device)
        return self._inner.barrier(opts)

    def send(self, tensors, dst, tag=0):
        return self._call("send", tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._call("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._call("recv_anysource", tensors, tag)

    # torch >= 2.13 routes the tensor-in/tensor-out collectives through these
    # names; the C++ defaults would dispatch to gloo with neuron tensors.
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts if opts is not None else torch.distributed.AllgatherOptions()
        return self._call("allgather_coalesced", output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        # gloo has no coalesced form: run them one by one (the simulator is synchronous).
        return self._each(self._allgather_base, outputs, inputs, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._each(self._allgather_base, outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._each(self._reduce_scatter_base, outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._each(self._reduce_scatter_base, outputs, inputs, opts)

    @staticmethod
    def _each(op: Any, outputs: list, inputs: list, opts: Any) -> Any:
        work = None
        for out, inp in zip(outputs, inputs, strict=True):
            if work is not None:
                work.wait()
            work = op(out, inp, opts)
        return work if work is not None else _completed_work(outputs)


def _completed_work(result: Any) -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> NeuronProcessGroup:
    sim = state()
    # The rule concerns the first (world) group only: subgroups (new_group,
    # DeviceMesh dimensions) are created once the device is in use.
    first_group = not torch.distributed.is_initialized()
    if first_group and sim.is_initialized():
        raise RuntimeAlreadyInitializedError(
            "ProcessGroupNeuron: the Neuron runtime of this process was initialised before "
            "init_process_group(backend='neuron') (simulated device, same rule as torch-neuronx). "
            "Do not touch the device (tensor.to('neuron'), torch.neuron.set_device(), "
            "get_device_properties()) before the process group exists."
        )
    local_rank = os.environ.get("LOCAL_RANK")
    if first_group and local_rank is not None and not os.environ.get("NEURON_RT_VISIBLE_CORES"):
        os.environ["NEURON_RT_VISIBLE_CORES"] = local_rank
        logger.debug("NEURON_RT_VISIBLE_CORES=%s set by the neuron process group", local_rank)
    sim.refresh()
    inner = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    group = NeuronProcessGroup(rank, world_size, inner)
    # c10d keeps the group name on the registered backends; functional
    # collectives (DTensor, DeviceMesh) resolve the group by that name.
    group._register_backend(torch.device(BACKEND_NAME), torch.distributed.ProcessGroup.BackendType.CUSTOM, inner)
    return group


def register(_module: object = None) -> None:
    """Register the ``"neuron"`` c10d backend (once torch.distributed is imported)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=[BACKEND_NAME])
    from ..import_hooks import when_imported

    when_imported("torch._dynamo", _hide_from_dynamo)


def _hide_from_dynamo(_module: object = None) -> None:
    """Run the collectives eagerly when called from code torch.compile is running.

    The real ProcessGroupNeuron is C++; this one is Python, so Dynamo would try
    to trace a collective that C++ calls back into (DDP's buffer broadcast
    inside a compiled forward) and fail on the gloo object it holds.
    """
    if getattr(NeuronProcessGroup, "_hidden_from_dynamo", False):
        return
    for name, member in list(vars(NeuronProcessGroup).items()):
        if callable(member) and not name.startswith("__") and not isinstance(member, staticmethod):
            setattr(NeuronProcessGroup, name, torch.compiler.disable(member, recursive=True))
    NeuronProcessGroup._hidden_from_dynamo = True
