"""Ops the real backend runs on the CPU, modelled: a host round trip per call instead of an eager compile.

TorchNeuron's operator compatibility table marks some ATen ops ``CPU_FALLBACK``: "the named ATen
operator runs on the CPU and the result is copied back to the Neuron device" (Neuron docs, Supported
PyTorch APIs and operators). Such an op compiles no NEFF; each call copies its device inputs to the
host and its results back. ``torch_neuronx.get_fallback_ops()`` lists them by op name.

The simulator runs the ops listed here the same way (:file:`csrc/kernels.cpp`): no eager signature,
and per call a round trip counted in :func:`~accelerate_neuron.simulator.stats` (``cpu_fallbacks``,
``cpu_fallback_d2h_bytes`` / ``cpu_fallback_h2d_bytes``, also included in ``d2h_bytes`` / ``h2d_bytes``)
and by op in ``cpu_fallback_ops`` and the stand-in ``torch_neuronx.get_fallback_ops()``. Ops run
inside a graph compiled by the ``"neuron"`` backend are not counted (the simulator does not model how
the backend partitions a compiled graph around an op it cannot lower).

Which ops: ``ACCELERATE_NEURON_SIM_CPU_FALLBACK_OPS`` (comma-separated ATen op names, ``none`` for
none), default :data:`DEFAULT_OPS`. The per-op list of a given torch-neuronx release is its
compatibility table; the default holds what this project could establish without one (README,
simulator fidelity table):

- ``aten::histc``: torch-mlir, through which TorchNeuron lowers ATen ops, has no lowering for it.
  Transformers' MoE ``grouped_mm`` path calls it on int32 expert ids on every non-CPU device.
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import settings
from .runtime import state

ENV = settings.env_name("sim_cpu_fallback_ops")
DEFAULT_OPS: tuple[str, ...] = (settings.setting("sim_cpu_fallback_ops").default,)

_configured: tuple[str, ...] = ()


def parse(value: str) -> tuple[str, ...]:
    """``"histc, aten::normal_"`` -> ``("aten::histc", "aten::normal_")``; ``none`` -> ``()``.

    Raises ``ValueError`` naming an entry that is no ATen operator of the installed torch.
    """
    import torch

    text = value.strip()
    if text.lower() == "none":
        return ()
    ops: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        bare = name.removeprefix("aten::")
        if "::" in bare or "." in bare or not hasattr(torch.ops.aten, bare):
            raise ValueError(
                f"{ENV}: {name!r} is not an ATen operator of this torch; expected comma-separated op names "
                f"without overload, e.g. 'aten::histc,aten::normal_', or 'none'"
            )
        ops.append(f"aten::{bare}")
    return tuple(dict.fromkeys(ops))


def from_env() -> tuple[str, ...]:
    """The ops the environment asks for (the default when unset)."""
    return parse(settings.get("sim_cpu_fallback_ops"))


def set_ops(ops: Iterable[str]) -> tuple[str, ...]:
    """Make exactly ``ops`` run on the host from now on; returns the previous set."""
    global _configured
    wanted = parse(",".join(ops)) if not isinstance(ops, str) else parse(ops)
    previous = _configured
    state().lib.nsim_set_cpu_fallback_ops("\n".join(wanted).encode())
    _configured = wanted
    return previous


def ops() -> tuple[str, ...]:
    """The ops the simulated device currently runs on the host."""
    return _configured


def counts() -> dict[str, int]:
    """Calls per op that ran on the host since the last reset or ``clear_op_tracking()``, first seen first."""
    lib = state().lib
    size = lib.nsim_cpu_fallback_counts(None, 0)
    buf = bytes(size)
    lib.nsim_cpu_fallback_counts(buf, size)
    out: dict[str, int] = {}
    for line in buf.decode().splitlines():
        name, _, n = line.partition("\t")
        if name:
            out[name] = int(n)
    return out


def clear_counts() -> None:
    state().lib.nsim_clear_cpu_fallback_counts()
