"""Run a callback when a module finishes importing (or now, if it already has).

This is how the plugin patches transformers and accelerate without importing
them on ``import torch``: the callback fires right after the user's own
``import transformers`` completes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable

logger = logging.getLogger(__name__)

Callback = Callable[[types.ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}
#: Awaited modules that were already executing when asked for (``transformers.trainer`` runs ``import torch``,
#: whose entry point schedules the patches): their loader cannot be wrapped any more, so they fire at the next
#: import of anything once they have finished.
_midway: set[str] = set()


def _run(callback: Callback, module: types.ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a failing hook must never break the user's import
        logger.warning(
            "accelerate_neuron: post-import hook %r for %s failed; continuing without it",
            getattr(callback, "__qualname__", callback),
            module.__name__,
            exc_info=True,
        )


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported; at once if it already is."""
    module = sys.modules.get(name)
    if module is not None and not _is_initialising(module):
        _run(callback, module)
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if module is not None:
            _midway.add(name)
        _ensure_finder()


def _fire_finished() -> None:
    """Fire the callbacks of awaited modules that were mid-import when asked for and have finished since."""
    if not _midway:
        return
    with _lock:
        finished = [n for n in _midway if n in sys.modules and not _is_initialising(sys.modules[n])]
        _midway.difference_update(finished)
        _midway.intersection_update(n for n in _midway if n in sys.modules)  # a failed import never finishes
    for name in finished:
        _fire(name, sys.modules[name])


def _is_initialising(module: types.ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(spec is not None and getattr(spec, "_initializing", False))


def pending() -> dict[str, int]:
    """Modules still awaited, with their number of callbacks (for status reports)."""
    with _lock:
        return {name: len(cbs) for name, cbs in _pending.items()}


def _fire(name: str, module: types.ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        _run(callback, module)


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # Restore the original loader so reload() and introspection see it.
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        _fire(self._name, module)

    def __getattr__(self, item: str):
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    _busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        _fire_finished()
        if fullname not in _pending or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderWrapper(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def _ensure_finder() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
