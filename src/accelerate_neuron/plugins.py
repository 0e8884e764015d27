"""The pluggy plugin manager: built-in features and third-party plugins alike.

The ``disable`` setting (``ACCELERATE_NEURON_DISABLE``): ``1`` / ``all`` turns
every patch off; ``placement,generation`` skips those plugins (built-in or
third-party entry point names). Unknown names are reported once with the valid
ones.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import hookspecs, settings
from .records import as_dict

logger = logging.getLogger(__name__)

PROJECT = "accelerate_neuron"
ENTRY_POINT_GROUP = "accelerate_neuron"
DISABLE_ENV = settings.env_name("disable")

#: Built-in plugins, in registration order: name -> module.
BUILTIN_PLUGINS: dict[str, str] = {
    "placement": "accelerate_neuron.builtin.placement",
    "generation": "accelerate_neuron.builtin.generation",
    "training": "accelerate_neuron.builtin.training",
    "launch": "accelerate_neuron.builtin.launch",
    "inference": "accelerate_neuron.builtin.inference",
    "moe": "accelerate_neuron.builtin.moe",
    "serving": "accelerate_neuron.builtin.serving",
    "warmup": "accelerate_neuron.builtin.warmup",
    "regions": "accelerate_neuron.builtin.regions",
    "tracing": "accelerate_neuron.builtin.tracing",
}


@dataclass
class PluginInfo:
    name: str
    kind: str  # "builtin" or "third-party"
    active: bool
    detail: str = ""
    module: str = ""

    def as_dict(self) -> dict[str, Any]:
        return as_dict(self)


def disable_setting() -> settings.Plugins:
    """The ``disable`` setting: every plugin off, or the names to skip."""
    return settings.get("disable")


class _Manager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.third_party: list[object] = []
        self.warned: set[str] = set()

    def load(self, setting: settings.Plugins) -> None:
        for name, module_name in BUILTIN_PLUGINS.items():
            if setting.all or name in setting.names:
                self.infos[name] = PluginInfo(name, "builtin", False, f"disabled by {DISABLE_ENV}", module_name)
                continue
            try:
                module = importlib.import_module(module_name)
                self.pm.register(module, name=name)
                self.infos[name] = PluginInfo(name, "builtin", True, "", module_name)
            except Exception as exc:
                logger.warning("accelerate_neuron: built-in plugin %r failed to load: %s", name, exc, exc_info=True)
                self.infos[name] = PluginInfo(name, "builtin", False, f"failed to load: {exc}", module_name)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self.infos:
                logger.warning(
                    "accelerate_neuron: third-party plugin %r (%s) has the name of a built-in; ignored",
                    ep.name,
                    ep.value,
                )
                continue
            if setting.all or ep.name in setting.names:
                self.infos[ep.name] = PluginInfo(ep.name, "third-party", False, f"disabled by {DISABLE_ENV}", ep.value)
                continue
            try:
                before = set(self.pm.get_plugins())
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
                self.third_party.extend(set(self.pm.get_plugins()) - before)
                self.infos[ep.name] = PluginInfo(ep.name, "third-party", True, "", ep.value)
            except Exception as exc:
                logger.warning(
                    "accelerate_neuron: third-party plugin %r (%s) failed to load and is skipped: %s",
                    ep.name,
                    ep.value,
                    exc,
                )
                self.infos[ep.name] = PluginInfo(ep.name, "third-party", False, f"failed to load: {exc}", ep.value)
        unknown = sorted(setting.names - set(self.infos))
        if unknown:
            logger.warning(
                "accelerate_neuron: %s names unknown plugin(s) %s; valid names: %s (or 1/all for every patch)",
                DISABLE_ENV,
                ", ".join(repr(u) for u in unknown),
                ", ".join(sorted(self.infos)),
            )

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call ``hook``; if a third-party implementation raises, warn once and use the built-ins."""
        caller = getattr(self.pm.hook, hook)
        try:
            return caller(**kwargs)
        except Exception as exc:
            if not self.third_party:
                raise
            if hook not in self.warned:
                self.warned.add(hook)
                logger.warning(
                    "accelerate_neuron: a plugin's %s hook raised %s: %s; using the built-in behaviour",
                    hook,
                    type(exc).__name__,
                    exc,
                )
            return self.pm.subset_hook_caller(hook, remove_plugins=self.third_party)(**kwargs)


_lock = threading.Lock()
_manager: _Manager | None = None


def manager() -> _Manager:
    """The process's plugin manager, loading plugins on first use."""
    global _manager
    with _lock:
        if _manager is None:
            mgr = _Manager()
            mgr.load(disable_setting())
            _manager = mgr
        return _manager


@contextlib.contextmanager
def registered(plugin: object, name: str | None = None) -> Iterator[object]:
    """``plugin``'s hook implementations active inside the block only (tests, benchmarks, notebooks)."""
    pm = manager().pm
    pm.register(plugin, name=name)
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def call_hook(hook: str, **kwargs: Any) -> Any:
    """Call a hook of :mod:`accelerate_neuron.hookspecs` on every active plugin."""
    return manager().call(hook, **kwargs)


def plugin_infos() -> list[PluginInfo]:
    return list(manager().infos.values())


def reset() -> None:
    """Forget the manager (tests); the next use reloads plugins from the environment."""
    global _manager
    with _lock:
        _manager = None
