"""Activation: what happens on ``import torch`` (entry point) or ``import accelerate_neuron``.

On a machine without Neuron this reads a few settings, looks for
``torch_neuronx`` on the path and stops: nothing is imported, nothing patched.
With a Neuron device (real, or simulated on request) it loads the plugins and
schedules their patches for the moment transformers / accelerate are imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import settings

logger = logging.getLogger(__name__)

SIMULATE_ENV = settings.env_name("simulate")
SIM_HBM_ENV = settings.env_name("sim_hbm")

# lru_cached upstream Neuron checks: a call made before the backend registered
# would otherwise answer "no Neuron" for the rest of the process.
_CACHED_GATES = (
    ("accelerate.utils.imports", "is_neuron_available"),
    ("transformers.utils.import_utils", "is_torch_neuron_available"),
)


@dataclass
class ActivationState:
    activated: bool = False
    source: str = ""
    neuron: str | None = None  # "real", "simulated" or None
    inert_reason: str = ""
    error: str = ""
    seconds: float = 0.0
    actions: list[str] = field(default_factory=list)
    scheduled: dict[str, tuple[str, Any]] = field(default_factory=dict)  # key -> (plugin, Patch)


_lock = threading.RLock()
_state = ActivationState()
_in_progress = threading.local()


def state() -> ActivationState:
    return _state


def activate(source: str = "import accelerate_neuron") -> ActivationState:
    """Activate once per process. Never raises: a failure leaves the plugin inert."""
    if _state.activated or getattr(_in_progress, "active", False):
        return _state
    with _lock:
        if _state.activated:
            return _state
        _in_progress.active = True
        started = time.perf_counter()
        try:
            _state.source = source
            _activate()
        except Exception as exc:  # the contract: activation never breaks the user's import
            _state.error = f"{type(exc).__name__}: {exc}"
            _state.inert_reason = "activation failed"
            from ._autoload import said_once

            said_once(exc)
        finally:
            _state.activated = True
            _state.seconds = time.perf_counter() - started
            _in_progress.active = False
    return _state


def _activate() -> None:
    if settings.get_quietly("test_raise_in_activation"):
        raise RuntimeError(f"raised on request ({settings.env_name('test_raise_in_activation')})")
    import torch  # noqa: F401 - already importing when called from the entry point

    from . import accelerate_config, device, logs

    # First: the block `accelerate launch` handed over may set the log level and the plugins to skip.
    problem = accelerate_config.install_from_environment()
    logs.apply_level()
    if problem:
        logger.warning("accelerate_neuron: the neuron_config handed over by accelerate launch is ignored: %s", problem)

    # A device registered later (simulator.install()) is announced through device.py: the
    # simulator need not know this module exists.
    device.on_registered(on_device_registered)
    _load_real_backend()
    _maybe_simulate()
    _state.neuron = device.kind()
    if _state.neuron == "real":
        _publish_new_neffs()
    if _state.neuron is None:
        _state.inert_reason = "no Neuron device (real or simulated): nothing is patched"
        return
    try:
        disable = settings.resolve("disable")
    except ValueError as exc:  # cannot happen today (every text names plugins); never break the import
        logger.warning("accelerate_neuron: %s; every plugin stays on", exc)
        disable = settings.Value(settings.setting("disable").default, "default")
    _guard_xla()
    if disable.value.all:
        _state.inert_reason = f"{disable.describe()}: no patch applied"
        return
    refresh_upstream_gates()
    _schedule_patches()


def _publish_new_neffs() -> None:
    """With a remote compile cache on a real device: publish at exit the NEFFs this process compiled."""
    if settings.get_quietly("remote_cache") is None:
        return
    try:
        from .compile_cache import real_neff

        real_neff.start()
    except Exception as exc:  # the remote cache is an optimisation: never a reason for a failed import
        logger.warning("accelerate_neuron: the remote compile cache is not used: %s", exc)


def _load_real_backend() -> None:
    """Import a real torch_neuronx before anything asks upstream whether Neuron exists."""
    from . import device

    if device.neuron_module() is not None or not device.torch_neuronx_installed():
        return
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # e.g. PyPI's placeholder package raises ImportError
        logger.debug("torch_neuronx is installed but cannot be imported: %s", exc)


def _maybe_simulate() -> None:
    try:
        cores = settings.get("simulate")
    except ValueError as exc:
        logger.warning("accelerate_neuron: ignoring %s", exc)
        return
    if not cores:
        return
    from . import device, simulator

    if device.kind() == "real":
        logger.warning("accelerate_neuron: %s ignored: a real Neuron device is present", SIMULATE_ENV)
        return
    try:
        simulator.install(cores=cores, hbm=settings.get("sim_hbm"))
        _state.actions.append(f"simulated Neuron device installed ({SIMULATE_ENV}={cores})")
        from .simulator import report  # `accelerate-neuron simulate`: per-process dry-run record at exit

        report.install_from_env()
    except Exception as exc:
        # One line on `import torch` (a compiler's output can run to pages): the rest at debug level.
        first, _, rest = str(exc).strip().partition("\n")
        logger.warning(
            "accelerate_neuron: could not install the simulated Neuron device: %s%s",
            first,
            f" (and {len(rest.splitlines())} more line(s) at debug level: {settings.env_name('log_level')}=debug)"
            if rest
            else "",
        )
        logger.debug("accelerate_neuron: the simulated Neuron device failed to install", exc_info=True)


def _guard_xla() -> None:
    """Keep transformers/accelerate off the legacy torch_xla path on a native-backend host."""
    import importlib.machinery

    if importlib.machinery.PathFinder.find_spec("torch_xla") is None:
        return
    if "USE_TORCH_XLA" in os.environ:
        return
    os.environ["USE_TORCH_XLA"] = "0"
    _state.actions.append("USE_TORCH_XLA=0 set: torch_xla is installed beside the native Neuron backend")
    late = [m for m in ("accelerate", "transformers") if m in sys.modules]
    if late:
        logger.warning(
            "accelerate_neuron: %s was imported before the Neuron backend activated and may take the "
            "legacy torch_xla path; set USE_TORCH_XLA=0 in the environment.",
            " and ".join(late),
        )


def refresh_upstream_gates() -> None:
    """Clear upstream's cached "is Neuron available" answers (if already computed)."""
    for module_name, attr in _CACHED_GATES:
        module = sys.modules.get(module_name)
        func = getattr(module, attr, None) if module is not None else None
        cache_clear = getattr(func, "cache_clear", None)
        if callable(cache_clear):
            cache_clear()
            _state.actions.append(f"cleared the cache of {module_name}.{attr}")
    from .import_hooks import when_imported

    # Also when the module is imported later in a process where the backend
    # may register after it (simulator.install(), a late `import torch_neuronx`).
    for module_name, attr in _CACHED_GATES:
        if module_name not in sys.modules:
            when_imported(module_name, lambda m, a=attr: getattr(getattr(m, a, None), "cache_clear", lambda: None)())


def _schedule_patches() -> None:
    from . import patching
    from .import_hooks import when_imported
    from .plugins import manager

    mgr = manager()
    for impl in mgr.pm.hook.neuron_patches.get_hookimpls():
        plugin_name = mgr.pm.get_name(impl.plugin) or impl.plugin_name
        try:
            patches = impl.function() or []
        except Exception as exc:
            logger.warning("accelerate_neuron: plugin %r failed to list its patches: %s", plugin_name, exc)
            continue
        for patch in patches:
            _state.scheduled[patch.key] = (plugin_name, patch)
            when_imported(patch.module, lambda _m, p=patch, n=plugin_name: patching.apply(p, plugin=n))
            for alias in patch.aliases:
                alias_module = alias.rpartition(".")[0]
                if alias_module != patch.module:
                    when_imported(alias_module, lambda _m, p=patch, a=alias: patching.patch_aliases_now(p.key, [a]))


def on_device_registered(source: str) -> None:
    """A Neuron device appeared after activation (``simulator.install()``): activate for it."""
    global _state
    with _lock:
        if getattr(_in_progress, "active", False):
            return
        if _state.activated and _state.neuron is None and not _state.error:
            previous = _state
            _state = ActivationState(actions=list(previous.actions))
            activate(f"{previous.source}; then {source}")
        elif _state.neuron is not None:
            refresh_upstream_gates()


def reapply_patches() -> int:
    """Apply every scheduled patch whose module is imported (after a revert in tests)."""
    from . import patching

    applied = 0
    for plugin_name, patch in list(_state.scheduled.values()):
        if patch.module in sys.modules:
            applied += patching.apply(patch, plugin=plugin_name).status == "applied"
    return applied


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Stock upstream inside the block: every patch reverted, then re-applied (tests' and benchmarks' baseline)."""
    from . import patching

    patching.revert_all()
    try:
        yield
    finally:
        reapply_patches()
