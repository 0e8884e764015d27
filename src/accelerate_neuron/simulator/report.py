"""Per-process dry-run records for ``accelerate-neuron simulate``.

When ``ACCELERATE_NEURON_REPORT_DIR`` is set (the ``simulate`` command sets it
for every process it starts; every process those start inherits it: the workers
of ``torchrun`` / ``accelerate launch``, multiprocessing's spawn and forkserver
children, ``subprocess`` children, Ray's workers), activation calls
:func:`install_from_env`. The process then writes ``process-<pid>.json`` there:
:func:`simulator.stats() <accelerate_neuron.simulator.stats>`, what the backend's
own metrics functions report (:mod:`accelerate_neuron.backend_metrics`), and
where its models' weights were. It is written when the process ends, however it
ends, as far as the process can see its end coming:

- at exit (``atexit``), and when a multiprocessing child's target returns (fork
  and forkserver children leave through ``os._exit``, which skips ``atexit``);
- on SIGTERM, and on SIGINT where Python's own handler is not installed, when
  the process left the signal's default action in place (a parent's
  ``Process.terminate()``, ``transformers serve`` stopping its model's process,
  ``simulate`` ending the tree): the record is written, then the signal's
  default action ends the process as it would have;
- while it works, in a Ray worker (Ray sets ``RAY_RAYLET_PID`` for the processes
  it starts): Ray ends its workers with ``ray.kill``, which runs nothing in the
  process, so the record is rewritten every :data:`REFRESH_SECONDS` while the
  device counters change.

A forked child inherits its parent's counters: it writes no record of its own.

Models are found without touching upstream code: torch's global module and
parameter registration hooks note every module tree as it is built, and a
``weakref.finalize`` on each root records its placement when it is freed, so
a model built inside ``main()`` is still reported after ``main()`` returned.
The finalizer holds the root's ``_modules`` / ``_parameters`` / ``_buffers``
dicts, never the module itself, so no model lives longer than it would.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import settings

logger = logging.getLogger(__name__)

REPORT_DIR_ENV = settings.env_name("report_dir")
FORMAT_VERSION = 1

#: Caps that keep one process's file small whatever the script does.
MAX_MODELS = 8
MAX_PLACEMENT_ENTRIES = 64
MAX_SIGNATURES = 5000

#: How often a process that can be ended without notice (a Ray worker) rewrites its record while it works.
REFRESH_SECONDS = 1.0

_lock = threading.Lock()
_installed = False
_installed_pid: int | None = None
_final_written = False
#: Set once the final record is written: the refresher then stops (it must not replace it with an older one).
_refresh_stop = threading.Event()


# ------------------------------------------------------------------ placement


def _tensor_bytes(tensor: Any) -> int:
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except Exception:
        return 0


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _subtree(
    prefix: str,
    modules: Mapping[str, Any],
    params: Mapping[str, Any],
    buffers: Mapping[str, Any],
    seen_tensors: set[int],
    seen_modules: set[int],
) -> tuple[dict[str, int], list[list[str]], int]:
    """(bytes per device, [path, device] entries, parameter count) of one module tree."""
    per_device: dict[str, int] = {}
    own: list[list[str]] = []
    numel = 0
    for is_param, table in ((True, params), (False, buffers)):
        for name, tensor in table.items():
            if tensor is None or id(tensor) in seen_tensors:
                continue  # tied weights are counted where first met
            seen_tensors.add(id(tensor))
            device = str(tensor.device)
            per_device[device] = per_device.get(device, 0) + _tensor_bytes(tensor)
            if is_param:
                numel += int(tensor.numel())
            own.append([_join(prefix, name), device])
    children: list[list[str]] = []
    for name, child in modules.items():
        if child is None or id(child) in seen_modules:
            continue
        seen_modules.add(id(child))
        child_dict = getattr(child, "__dict__", {})
        sub_bytes, sub_entries, sub_numel = _subtree(
            _join(prefix, name),
            child_dict.get("_modules", {}),
            child_dict.get("_parameters", {}),
            child_dict.get("_buffers", {}),
            seen_tensors,
            seen_modules,
        )
        for device, n in sub_bytes.items():
            per_device[device] = per_device.get(device, 0) + n
        numel += sub_numel
        children.extend(sub_entries)
    if len(per_device) == 1:
        return per_device, [[prefix, next(iter(per_device))]], numel
    return per_device, own + children, numel


#: Child names under which wrappers keep the wrapped model.
_WRAPPED_AS = ("_orig_mod", "module")
_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def compress_entries(entries: Iterable[list[str]]) -> list[list[str]]:
    """``model.layers.0``..``model.layers.11`` on one device -> ``model.layers.0-11``."""
    out: list[list[str]] = []
    run: tuple[str, int, int, str] | None = None  # (parent, first, last, device)

    def flush() -> None:
        if run is not None:
            parent, first, last, device = run
            span = str(first) if first == last else f"{first}-{last}"
            out.append([f"{parent}.{span}", device])

    for path, device in entries:
        match = _INDEXED.match(path)
        if match:
            parent, index = match.group(1), int(match.group(2))
            if run is not None and run[0] == parent and run[3] == device and run[2] + 1 == index:
                run = (parent, run[1], index, device)
                continue
            flush()
            run = (parent, index, index, device)
            continue
        flush()
        run = None
        out.append([path, device])
    flush()
    return out


def summarize_tree(
    name: str,
    modules: Mapping[str, Any],
    params: Mapping[str, Any],
    buffers: Mapping[str, Any],
    seen_tensors: set[int] | None = None,
) -> dict[str, Any]:
    """Where the weights of a module tree are, from its registration dicts.

    ``seen_tensors`` collects the ids of the tensors met (shared weights are
    counted once across the trees summarised with the same set).
    """
    # Wrappers (torch.compile's OptimizedModule, DistributedDataParallel): report the model inside.
    only = next(iter(modules), None) if len(modules) == 1 and not params and not buffers else None
    inner = modules[only] if only in _WRAPPED_AS else None
    if inner is not None:
        d = inner.__dict__
        name = f"{type(inner).__name__} ({name})"
        modules, params, buffers = d["_modules"], d["_parameters"], d["_buffers"]
    seen = set() if seen_tensors is None else seen_tensors
    per_device, entries, numel = _subtree("", modules, params, buffers, seen, set())
    compressed = compress_entries(entries)
    return {
        "model": name,
        "parameters": numel,
        "bytes": dict(sorted(per_device.items(), key=lambda kv: -kv[1])),
        "placement": compressed[:MAX_PLACEMENT_ENTRIES],
        "placement_truncated": max(0, len(compressed) - MAX_PLACEMENT_ENTRIES),
    }


def summarize_module(module: Any, seen_tensors: set[int] | None = None) -> dict[str, Any]:
    """Where the weights of ``module`` (an ``nn.Module``) are: bytes per device, compressed map."""
    d = module.__dict__
    return summarize_tree(type(module).__name__, d["_modules"], d["_parameters"], d["_buffers"], seen_tensors)


# ------------------------------------------------------------------ model tracking


class _Tracker:
    """Notes module trees as they are built; records each root's placement when it is freed.

    A root is a module with no live parent: a model, or a model whose wrapper
    (``torch.compile``'s ``OptimizedModule``, a PEFT wrapper) was freed.
    """

    FINGERPRINT = 4  # tensors remembered (weakly) per freed record, to spot a model still alive elsewhere

    def __init__(self) -> None:
        self.parent: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()
        self.roots: dict[int, tuple[weakref.ref, weakref.finalize]] = {}
        self.freed: list[tuple[dict[str, Any], list[weakref.ref]]] = []

    def has_live_parent(self, module: Any) -> bool:
        ref = self.parent.get(module)
        return ref is not None and ref() is not None

    # The two hooks run inside the user's `module.x = ...`: they must never raise (a module class
    # may be unhashable or not weak-referenceable; it is then simply not tracked). Dynamo traces
    # them when a compiled forward assigns a module attribute: their id() calls would then break
    # the graph, so the dry run would report more graphs than the script compiles on its own.

    def on_module(self, parent: Any, name: str, child: Any) -> None:
        if _compiling():
            return
        try:
            if child is not None:
                self.parent[child] = weakref.ref(parent)
                entry = self.roots.pop(id(child), None)
                if entry is not None:
                    entry[1].detach()
            self.candidate(parent)
        except Exception:
            pass

    def on_parameter(self, module: Any, name: str, param: Any) -> None:
        if _compiling():
            return
        try:
            if param is not None:
                self.candidate(module)
        except Exception:
            pass

    def candidate(self, module: Any) -> None:
        key = id(module)
        if key in self.roots or self.has_live_parent(module):
            return
        d = module.__dict__
        fin = weakref.finalize(
            module, self.on_freed, key, type(module).__name__, d["_modules"], d["_parameters"], d["_buffers"]
        )
        fin.atexit = False  # live roots are summarised by the exit writer itself
        self.roots[key] = (weakref.ref(module), fin)

    def on_freed(self, key: int, name: str, modules: Any, params: Any, buffers: Any) -> None:
        self.roots.pop(key, None)
        try:
            summary = summarize_tree(name, modules, params, buffers)
            fingerprint = [weakref.ref(t) for t in _first_tensors(modules, params, self.FINGERPRINT)]
        except Exception:  # never let a finalizer raise into the user's program
            return
        # Trees that never left the meta device (shape probes, empty-weight skeletons) placed nothing.
        if not set(summary["bytes"]) - {"meta"}:
            return
        summary["alive_at_exit"] = False
        self.freed.append((summary, fingerprint))
        # Keep the biggest few: a script that builds many small modules stays cheap.
        if len(self.freed) > 4 * MAX_MODELS:
            self.freed.sort(key=lambda item: _total_bytes(item[0]), reverse=True)
            del self.freed[MAX_MODELS:]

    def live_roots(self) -> list[Any]:
        found = {}
        for ref, _fin in list(self.roots.values()):
            module = ref()
            try:
                if module is not None and not self.has_live_parent(module):
                    found[id(module)] = module
            except TypeError:  # an unhashable module class: it is its own root
                found[id(module)] = module
        for module in list(self.parent.keys()):
            if not self.has_live_parent(module):  # its wrapper or parent was freed; it lives on
                found[id(module)] = module
        return list(found.values())

    def models(self) -> list[dict[str, Any]]:
        found = []
        live_tensors: set[int] = set()
        for module in self.live_roots():
            try:
                summary = summarize_module(module, seen_tensors=live_tensors)
            except Exception:
                continue
            if summary["bytes"]:
                summary["alive_at_exit"] = True
                found.append(summary)
        for summary, fingerprint in self.freed:
            alive = [ref() for ref in fingerprint]
            if any(t is not None and id(t) in live_tensors for t in alive):
                continue  # the same weights are reported by a live root
            found.append(summary)
        found.sort(key=_total_bytes, reverse=True)
        return found[:MAX_MODELS]


def _first_tensors(modules: Mapping[str, Any], params: Mapping[str, Any], limit: int) -> list[Any]:
    """Up to ``limit`` parameters of a tree, breadth first."""
    out = [p for p in params.values() if p is not None][:limit]
    queue = list(modules.values())
    while queue and len(out) < limit:
        child = queue.pop(0)
        if child is None:
            continue
        d = child.__dict__
        out.extend(p for p in d.get("_parameters", {}).values() if p is not None)
        queue.extend(d.get("_modules", {}).values())
    return out[:limit]


def _total_bytes(summary: Mapping[str, Any]) -> int:
    return sum(summary.get("bytes", {}).values())


_tracker: _Tracker | None = None


def _compiling() -> bool:
    """True while Dynamo traces (a constant to it: the hook's body is then dead code)."""
    import torch

    return torch.compiler.is_compiling()


def _track_models() -> None:
    global _tracker
    from torch.nn.modules import module as nn_module

    tracker = _Tracker()
    nn_module.register_module_module_registration_hook(tracker.on_module)
    nn_module.register_module_parameter_registration_hook(tracker.on_parameter)
    _tracker = tracker


# ------------------------------------------------------------------ the record


def collect() -> dict[str, Any]:
    """This process's dry-run record: simulator counters, models, launch identity."""
    from .. import backend_metrics, moe_accounting, padding, speculation_accounting
    from . import stats

    counters = stats()
    signatures = counters.get("eager_signature_list", [])
    if len(signatures) > MAX_SIGNATURES:
        counters["eager_signature_list"] = signatures[:MAX_SIGNATURES]
        counters["eager_signature_list_truncated"] = len(signatures) - MAX_SIGNATURES
    env = os.environ
    return {
        "format": FORMAT_VERSION,
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "rank": env.get("RANK"),
        "local_rank": env.get("LOCAL_RANK"),
        "world_size": env.get("WORLD_SIZE"),
        "stats": counters,
        # What the backend's own functions say (torch.neuron.get_dynamo_metrics(), torch_neuronx.metrics,
        # torch_neuronx.get_fallback_ops()): the report reads these as it would on Trainium.
        "backend": backend_metrics.snapshot().as_dict(),
        # Positions computed and real per call family (what bucketing cost), counted by the plugin side.
        "padding": padding.padding_stats(),
        "models": _tracker.models() if _tracker is not None else [],
        # Mixture-of-experts calls: the experts' FLOPs per call shape against a sparse dispatch.
        "moe": moe_accounting.snapshot(),
        # Speculative generate() calls: candidates accepted per target forward, target forwards per token.
        "speculation": speculation_accounting.snapshot(),
        "models_tracked": _tracker is not None,
    }


def write(directory: str | os.PathLike[str], *, quiet: bool = False) -> Path | None:
    """Write this process's record to ``directory``; never raises (runs at exit, in handlers, in a thread)."""
    try:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"process-{os.getpid()}.json"
        partial = target.with_name(f"{target.name}.{threading.get_ident()}.partial")
        partial.write_text(json.dumps(collect(), default=str))
        os.replace(partial, target)
        return target
    except Exception as exc:
        (logger.debug if quiet else logger.warning)(
            "accelerate_neuron: could not write the dry-run record to %s: %s", directory, exc
        )
        return None


def write_final(directory: str | os.PathLike[str]) -> Path | None:
    """The record as the process ends: written once, and only by the process that installed the writer."""
    global _final_written
    if os.getpid() != _installed_pid:
        return None  # a forked child: its counters are its parent's
    with _lock:
        if _final_written:
            return None
        _final_written = True
        _refresh_stop.set()
    return write(directory)


def _on_signal(directory: str) -> Any:
    def handler(signum: int, frame: Any) -> None:
        write_final(directory)
        # Then what the signal would have done without us: the default action, so the parent sees -signum.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


def _catch_signals(directory: str) -> None:
    """Write the record on SIGTERM / SIGINT where the process left their default action (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            # Python's SIGINT handler raises KeyboardInterrupt: the process then exits through atexit.
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _on_signal(directory))
        except (ValueError, OSError):  # not settable here
            continue


def _at_multiprocessing_exit(directory: str) -> None:
    """Write the record when a multiprocessing child's target returns: fork / forkserver children then
    ``os._exit``. A child clears the finalizers it was started with, then runs its after-fork hooks: a
    finalizer registered while it unpickled its target (imports torch) is registered again from one."""
    from multiprocessing import util

    def register(_owner: object = None) -> None:
        if os.getpid() == _installed_pid:
            util.Finalize(None, write_final, args=(directory,), exitpriority=0)

    register()  # activated inside the target (torch imported there): no clearing comes after this
    util.register_after_fork(_AFTER_FORK_OWNER, register)


class _Owner:
    """A weak-referenceable object that owns the after-fork hook (multiprocessing keeps hooks by weak reference)."""


_AFTER_FORK_OWNER = _Owner()


def _fingerprint() -> tuple[int, ...]:
    """Cheap counters that change whenever the record would: transfers, eager ops, graphs handed to the backend."""
    from . import compile_backend
    from .runtime import get_state_or_none

    state = get_state_or_none()
    if state is None or not state.is_initialized():
        return ()
    lib = state.lib
    return (*(int(lib.nsim_counter(i)) for i in range(4)), *compile_backend.cache_counts())


def _refresh(directory: str) -> None:
    written: tuple[int, ...] = ()
    while not _refresh_stop.wait(REFRESH_SECONDS):
        try:
            current = _fingerprint()
        except Exception:
            continue
        if current and current != written:
            if write(directory, quiet=True) is not None:
                written = current


def _refresh_while_working(directory: str) -> None:
    """In a process its engine ends without running anything in it (a Ray worker), keep the record current."""
    if not os.environ.get("RAY_RAYLET_PID"):
        return
    threading.Thread(target=_refresh, args=(directory,), name="accelerate-neuron-record", daemon=True).start()


def install_from_env() -> bool:
    """Track models and write a record as the process ends if ``ACCELERATE_NEURON_REPORT_DIR`` is set."""
    global _installed, _installed_pid
    directory = settings.get_quietly("report_dir")
    if not directory:
        return False
    with _lock:
        if _installed:
            return True
        _installed = True
        _installed_pid = os.getpid()
    try:
        _track_models()
    except Exception as exc:
        logger.warning("accelerate_neuron: dry-run model tracking unavailable (%s); memory figures only", exc)
    atexit.register(write_final, directory)
    _catch_signals(directory)
    _at_multiprocessing_exit(directory)
    _refresh_while_working(directory)
    return True
