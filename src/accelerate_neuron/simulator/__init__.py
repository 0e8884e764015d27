"""A simulated Neuron device: CPU-backed, registered as PyTorch's ``neuron`` device.

There is no Trainium in CI or on a laptop; this device is how the plugin is
tested and how users dry-run their scripts. It mirrors the native
torch-neuronx backend ("TorchNeuron": PrivateUse1 renamed ``neuron``,
``torch.neuron``, a ``"neuron"`` torch.compile backend and c10d backend) and
counts what Neuron pays for: graph compiles, op-by-op eager compiles per
(op, shapes, dtypes), host/device transfers, per-core memory.

Design choice: a small C++ library (OpenReg-style) built on first use against
the installed PyTorch, not a Python wrapper tensor subclass. Tensors on
``neuron:i`` are then ordinary ``torch.Tensor`` objects with real storage, so
``nn.Parameter``, ``type(param)(tensor, requires_grad=...)``, tied-weight
detection through ``untyped_storage().data_ptr()``, safetensors, ``torch.save``
/ ``torch.load(weights_only=True)``, autograd and torch.compile all behave as on
a real accelerator. Device memory is host memory: every operator without an
explicit kernel runs the CPU kernel on zero-copy aliases (one "eager op").

What is modelled and what is not (also in docs/fidelity.md):

- modelled: registration and ``torch.neuron`` API (with its gaps, e.g. no
  ``mem_get_info`` by default), per-core HBM budget and OOM, ``NEURON_RT_VISIBLE_CORES`` /
  ``NEURON_RT_NUM_CORES``, lazy runtime initialisation, fork-after-init
  refusal, per-core RNG, autocast policy, pinned host memory, device-mismatch
  errors, graph compiles of the ``"neuron"`` backend (AOTAutograd forward /
  backward graphs), eager signatures, transfer bytes, the c10d init-order rule,
  the persistent NEFF cache (:mod:`.neff_cache`: hits and misses across
  processes and runs, for graphs and eager signatures), the ops the real
  backend runs on the CPU (:mod:`.cpu_fallback`: a host round trip per call),
  the backend's own metrics API (:mod:`.backend_api`), ``mem_get_info`` of
  newer SDKs (``ACCELERATE_NEURON_SIM_MEM_GET_INFO=1``).
- not modelled: timing, numerics of Neuron kernels (results are CPU results,
  e.g. no bf16 matmul accumulation differences), LNC (cores
  are logical cores of ``ACCELERATE_NEURON_SIM_HBM`` each), the caching
  allocator (reserved == allocated), streams (all work is synchronous),
  collectives' performance (they run on gloo).
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import threading
from typing import Any

from ..sizes import parse_size
from .runtime import SimState, get_state_or_none, set_state

logger = logging.getLogger(__name__)

__all__ = ["SimulatorError", "install", "is_installed", "reset_stats", "stats"]

DEFAULT_HBM = "24GiB"
MAX_CORES = 128

_install_lock = threading.Lock()


class SimulatorError(RuntimeError):
    """The simulated device cannot be installed here (e.g. real Neuron hardware is present)."""


def is_installed() -> bool:
    """Whether the simulated device is registered in this process."""
    return get_state_or_none() is not None


def _real_torch_neuronx_present() -> bool:
    """A real (importable) torch-neuronx, as opposed to none or PyPI's placeholder."""
    import sys

    from . import torch_neuronx_shim

    module = sys.modules.get("torch_neuronx")
    if module is not None:
        return not torch_neuronx_shim.is_shim(module)
    if importlib.machinery.PathFinder.find_spec("torch_neuronx") is None:
        return False
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # PyPI's "torch-neuronx" placeholder raises ImportError
        logger.warning(
            "accelerate_neuron: an installed torch_neuronx cannot be imported (%s); "
            "it is not the Neuron SDK's package. The simulator stands in for it.",
            exc,
        )
        return False
    return True


def install(cores: int = 2, hbm: str | int = DEFAULT_HBM) -> None:
    """Register the simulated Neuron device with ``cores`` cores of ``hbm`` memory each.

    Idempotent for the same arguments. Refuses (``SimulatorError``) when a
    real torch-neuronx is present or another PrivateUse1 backend is
    registered: the simulator never shadows hardware.
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or not 1 <= cores <= MAX_CORES:
        raise ValueError(f"invalid number of simulated cores {cores!r}: expected an int in 1..{MAX_CORES}")
    hbm_bytes = parse_size(hbm, what="simulated HBM per core")
    if hbm_bytes <= 0:
        raise ValueError(f"invalid simulated HBM per core {hbm!r}: must be positive")

    import torch

    with _install_lock:
        current = get_state_or_none()
        if current is not None:
            if (current.total_cores, current.hbm_bytes) == (cores, hbm_bytes):
                return
            if current.is_initialized():
                raise SimulatorError(
                    f"the simulated device is already running with {current.total_cores} core(s) of "
                    f"{current.hbm_bytes} bytes; it cannot be resized after the runtime initialised"
                )
            current.total_cores, current.hbm_bytes = cores, hbm_bytes
            current.refresh()
            return

        backend = torch._C._get_privateuse1_backend_name()
        if backend != "privateuseone":
            raise SimulatorError(
                f"cannot install the simulated Neuron device: the PrivateUse1 backend is already "
                f"registered as {backend!r} (a real torch-neuronx or another out-of-tree backend)"
            )
        if _real_torch_neuronx_present():
            raise SimulatorError(
                "cannot install the simulated Neuron device: a real torch-neuronx is installed. "
                "The simulator never shadows Neuron hardware; unset ACCELERATE_NEURON_SIMULATE."
            )

        from ..import_hooks import when_imported
        from . import (
            _build,
            compile_backend,
            cpu_fallback,
            device_module,
            distributed,
            eager_cache,
            random_ops,
            torch_neuronx_shim,
        )

        # Settings first: a bad value stops the install before anything registers.
        fallback_ops = cpu_fallback.from_env()
        offer_mem_get_info = device_module.mem_get_info_from_env()
        lib = _build.load(torch)
        state = SimState(lib=lib, total_cores=cores, hbm_bytes=hbm_bytes)
        state.refresh()  # validates NEURON_RT_VISIBLE_CORES before anything registers
        set_state(state)
        cpu_fallback.set_ops(fallback_ops)
        device_module.offer_mem_get_info(offer_mem_get_info)
        torch.utils.rename_privateuse1_backend("neuron")
        torch._register_device_module("neuron", device_module)
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
        )
        random_ops.register()
        os.register_at_fork(after_in_child=lib.nsim_mark_bad_fork)
        eager_cache.settle_at_exit(_signatures)
        torch_neuronx_shim.install_finder()
        when_imported("torch._dynamo", compile_backend.register)
        when_imported("torch.distributed", distributed.register)
        logger.info("simulated Neuron device installed: %d core(s) x %d bytes", cores, hbm_bytes)

    from ..device import announce_registered

    announce_registered("simulator.install()")


def _signatures() -> list[str]:
    """The distinct eager signatures recorded since the last reset, in first-seen order."""
    from .runtime import state as get_state

    lib = get_state().lib
    size = lib.nsim_signatures(None, 0)
    while True:
        buf = bytes(size)
        # Another thread may run new ops between the two calls: the copy is made only if it fits.
        needed = lib.nsim_signatures(buf, size)
        if needed <= size:
            return [s for s in buf[:needed].decode().split("\n") if s]
        size = needed


def stats() -> dict[str, Any]:
    """What Neuron would have paid so far in this process.

    ``compiles``: graphs the ``"neuron"`` compiler compiled (AOTAutograd
    forward/backward/inference graphs that missed the NEFF cache);
    ``compile_cache_hits``: graphs loaded from it instead (compiled earlier by
    this process, a previous run, or another rank); ``graphs``: one record per
    graph handed to the backend, with input shapes and ``cache`` (``hit`` /
    ``miss``) and ``cache_key``; ``dynamo_graphs``: Dynamo graphs behind them;
    ``eager_signatures``: distinct (op, shapes, dtypes) run eagerly on a neuron
    device, which Neuron's eager mode compiles one by one on a cold cache, of
    which ``eager_cache_hits`` were loaded from the NEFF cache and
    ``eager_compiles`` compiled; ``eager_ops``: eager op executions;
    ``h2d_bytes`` / ``d2h_bytes`` / ``d2d_bytes``; ``cpu_fallbacks``: calls of
    ops the real backend runs on the CPU (:mod:`.cpu_fallback`), each a host
    round trip of ``cpu_fallback_d2h_bytes`` out and ``cpu_fallback_h2d_bytes``
    back (included in ``d2h_bytes`` / ``h2d_bytes``), by op in
    ``cpu_fallback_ops``; per-core ``memory_allocated``
    and ``max_memory_allocated`` (keyed by visible core index);
    ``compile_cache``: where the NEFF cache is and whether it is on.

    Reading the stats settles the eager signatures run since the last call
    against the NEFF cache (see :mod:`.eager_cache`).
    """
    from . import compile_backend, cpu_fallback, eager_cache, neff_cache
    from .runtime import state as get_state

    state = get_state()
    lib = state.lib
    count = state.device_count()
    signatures = _signatures()
    eager_hits, eager_misses = eager_cache.settle(signatures)
    graphs = compile_backend.graph_records()
    compiled, loaded = compile_backend.cache_counts()
    return {
        "compiles": compiled,
        "compile_cache_hits": loaded,
        "graphs": graphs,
        "dynamo_graphs": compile_backend.dynamo_graph_count(),
        "eager_signatures": len(signatures),
        "eager_signature_list": signatures,
        "eager_cache_hits": eager_hits,
        "eager_compiles": eager_misses,
        "eager_ops": int(lib.nsim_counter(3)),
        "h2d_bytes": int(lib.nsim_counter(0)),
        "d2h_bytes": int(lib.nsim_counter(1)),
        "d2d_bytes": int(lib.nsim_counter(2)),
        "cpu_fallbacks": int(lib.nsim_counter(4)),
        "cpu_fallback_d2h_bytes": int(lib.nsim_counter(5)),
        "cpu_fallback_h2d_bytes": int(lib.nsim_counter(6)),
        "cpu_fallback_ops": cpu_fallback.counts(),
        "memory_allocated": {i: int(lib.nsim_memory(i, 0)) for i in range(count)},
        "max_memory_allocated": {i: int(lib.nsim_memory(i, 1)) for i in range(count)},
        "cores": count,
        "visible_cores": list(state.visible),
        "hbm_per_core": state.hbm_bytes,
        "initialized": state.is_initialized(),
        "compile_cache": neff_cache.current().describe(),
    }


def reset_stats() -> None:
    """Zero the counters (compiles, eager signatures, transfers, peaks); memory in use stays.

    The NEFF cache keeps what was compiled: compiling the same graph or eager op
    again after a reset is a cache hit, as it is on Neuron.
    """
    from . import compile_backend, eager_cache
    from .runtime import state as get_state

    eager_cache.settle(_signatures())  # what ran before the reset still reaches the cache
    eager_cache.forget()
    get_state().lib.nsim_reset_stats()
    compile_backend.reset()
