"""Recompile watchdog: after warm-up, a new graph compile names the input whose shape changed.

On Neuron each compile costs minutes, so a training run that keeps
recompiling looks hung. The watchdog needs nothing from the backend, so it
works on real hardware and on the simulator alike:

- compiles are counted with Dynamo's compile-start callbacks
  (:mod:`..compile_counter`, shared with continuous batching's warning);
- the inputs of each call are read by a forward pre-hook on the outermost
  (compiled) module, outside the compiled region.

A call during which a compile started, past the first ``warmup`` calls, with
an input shape not seen in a compiled call before, is a recompile for a new
shape: warn once per input, naming old -> new shape and the fix. A shape the
training shape policy produces on purpose (a new length bucket) is expected
and only logged at debug level.

Where the backend reports its own compile metrics (``torch.neuron.get_dynamo_metrics()``,
read through :mod:`accelerate_neuron.backend_metrics`), the warning also says what the
new shape cost: the graphs the backend compiled for it and the seconds it spent. They
are read only after a call that compiled (the read synchronizes the device on Trainium).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ... import settings
from ..compile_counter import compile_count, ensure_compile_counter

logger = logging.getLogger(__name__)

WARMUP_ENV = settings.env_name("recompile_warmup")
DEFAULT_WARMUP = settings.setting("recompile_warmup").default

Signature = tuple[tuple[str, tuple[int, ...]], ...]


def warmup_from_env() -> int:
    """The ``recompile_warmup`` setting: forward calls before a new graph counts as a recompile."""
    return settings.get("recompile_warmup")


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str] | None = None) -> Signature:
    """(name, shape) of every tensor argument; positional ones take ``names`` (else ``arg<i>``)."""
    import torch

    names = names or []
    items = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return tuple((name, tuple(value.shape)) for name, value in items if isinstance(value, torch.Tensor))


def forward_parameter_names(module: Any) -> list[str]:
    """Positional parameter names of the user's ``forward`` under compile / DDP wrappers."""
    import inspect

    inner = module
    for _ in range(8):  # OptimizedModule._orig_mod, DistributedDataParallel.module, ...
        nxt = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if nxt is None or nxt is inner:
            break
        inner = nxt
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "(" + ", ".join(str(s) for s in shape) + ")"


def fix_for(old: tuple[int, ...] | None, new: tuple[int, ...] | None) -> str:
    """The remedy for a shape change ``old`` -> ``new``."""
    if old is not None and new is not None and len(old) == len(new) and old[1:] == new[1:] and old[:1] != new[:1]:
        return (
            "keep every batch the same size: dataloader_drop_last=True (the default on Neuron with torch_compile) "
            "or a batch size that divides the dataset"
        )
    return (
        "pad sequences to a few fixed lengths: use a stock collator (the plugin pads its batches to the buckets "
        "of ACCELERATE_NEURON_TRAIN_BUCKETS, e.g. 128,256,512), or pad_to_multiple_of= / padding='max_length' "
        "in your collator, and keep torch.compile(dynamic=False)"
    )


@dataclass
class _Mode:
    calls: int = 0
    last: Signature | None = None
    compiled: set[Signature] = field(default_factory=set)


class RecompileWatchdog:
    """Watches the forward calls of a compiled module for recompiles caused by new input shapes.

    ``expected(name, old_shape, new_shape)`` says a change is intended (a new
    length bucket); those compiles are not warned about. Only training-mode
    calls are watched: evaluation keeps its last, smaller batch on purpose.
    """

    def __init__(
        self,
        warmup: int | None = None,
        expected: Callable[[str, tuple[int, ...] | None, tuple[int, ...] | None], bool] | None = None,
        watch_eval: bool = False,
    ) -> None:
        self.warmup = warmup_from_env() if warmup is None else warmup
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r}: expected a number of forward calls >= 0")
        self.expected = expected
        self.watch_eval = watch_eval
        self.warned: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self._modes: dict[bool, _Mode] = {}
        self._pending: dict[int, tuple[bool, Signature, int]] = {}
        self._attached: weakref.WeakSet[Any] = weakref.WeakSet()
        self._names: dict[int, list[str]] = {}
        self._backend_seen = 0  # backend compile records accounted for by an earlier compiled call

    def attach(self, module: Any) -> bool:
        """Hook ``module`` (call it with the outermost, compiled wrapper); False if already attached."""
        if module in self._attached:
            return False
        module.register_forward_pre_hook(self._before, with_kwargs=True)
        module.register_forward_hook(self._after, with_kwargs=True)
        self._names[id(module)] = forward_parameter_names(module)
        self._attached.add(module)
        ensure_compile_counter()
        return True

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            ensure_compile_counter()
            sig = signature(args, kwargs, self._names.get(id(module)))
            self._pending[id(module)] = (bool(module.training), sig, compile_count())
        except Exception:  # a watchdog must never break the training step
            logger.debug("accelerate_neuron: recompile watchdog failed before a call", exc_info=True)

    def _after(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        pending = self._pending.pop(id(module), None)
        if pending is None:
            return
        try:
            training, sig, before = pending
            compiled = compile_count() > before
            self.observe(training, sig, compiled=compiled, backend=self._backend_graphs() if compiled else None)
        except Exception:
            logger.debug("accelerate_neuron: recompile watchdog failed after a call", exc_info=True)

    def _backend_graphs(self) -> tuple[Any, ...] | None:
        """The graphs the backend reports compiled since the last compiled call (``None``: it reports none)."""
        from ... import backend_metrics

        found = backend_metrics.compile_metrics()
        if found is None:
            return None
        graphs = found[0]
        new = graphs[self._backend_seen :] if len(graphs) >= self._backend_seen else graphs  # reset in between
        self._backend_seen = len(graphs)
        return new

    def observe(
        self, training: bool, sig: Signature, compiled: bool, backend: tuple[Any, ...] | None = None
    ) -> list[dict[str, Any]]:
        """Record one call; returns the shape changes it warned about.

        ``backend``: the graphs the backend reports it compiled during the call, when it reports them.
        """
        if not training and not self.watch_eval:
            return []
        mode = self._modes.setdefault(training, _Mode())
        mode.calls += 1
        previous = mode.last
        mode.last = sig
        if not compiled:
            return []
        new_shape = sig not in mode.compiled
        mode.compiled.add(sig)
        if mode.calls <= self.warmup or previous is None or not new_shape:
            return []
        old, new = dict(previous), dict(sig)
        changes = [(n, old.get(n), new.get(n)) for n in sorted(set(old) | set(new), key=_order(sig, previous))]
        changes = [c for c in changes if c[1] != c[2]]
        if self.expected is not None and changes and all(self.expected(*c) for c in changes):
            logger.debug("accelerate_neuron: compiled an expected new shape: %s", changes)
            return []
        fresh = [c for c in changes if c[0] not in self.warned]
        if not fresh:
            return []
        self.warned.update(name for name, _, _ in fresh)
        cost = {}
        if backend is not None:
            cost = {"backend_graphs": len(backend), "backend_compile_seconds": sum(g.compile_seconds for g in backend)}
        events = [{"input": n, "old": o, "new": w, "call": mode.calls, **cost} for n, o, w in fresh]
        self.events.extend(events)
        shapes = ", ".join(f"{n!r} {_fmt(o)} -> {_fmt(w)}" for n, o, w in fresh)
        fixes = list(dict.fromkeys(fix_for(o, w) for _, o, w in fresh))
        logger.warning(
            "accelerate_neuron: torch.compile compiled a new graph after warm-up (training call %d) because the "
            "input shape changed: %s. On Neuron every new input shape is another compile (minutes each)%s. Fix: %s.",
            mode.calls,
            shapes,
            _backend_cost(backend),
            "; and ".join(fixes),
        )
        return events


def _backend_cost(backend: tuple[Any, ...] | None) -> str:
    """``; the backend compiled 2 graph(s) of 1,234 nodes for this one, 95.3 s of compiling``, or nothing."""
    if not backend:
        return ""
    nodes = sum(g.nodes for g in backend)
    seconds = sum(g.compile_seconds for g in backend)
    timing = f", {seconds:.1f} s of compiling" if seconds else ""
    return f"; the backend compiled {len(backend)} graph(s) of {nodes:,} nodes for this one{timing}"


def _order(*sigs: Signature) -> Callable[[str], int]:
    names = [n for sig in sigs for n, _ in sig]
    return lambda name: names.index(name)
