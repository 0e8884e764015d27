"""Concurrent ``generate()`` calls on one model never share a KV cache.

On Neuron the plugin gives ``generate()`` a static KV cache by default. Transformers 4.x keeps the static
cache it builds on the model (``model._cache``) and resets and reuses it on the next call: two threads
generating on one model then write into one cache and both get wrong tokens (stock 4.x does the same with
``cache_implementation="static"``; with its default dynamic cache it did not). Where upstream keeps the
cache on the model, calls on that model take turns; elsewhere (5.x builds a cache per call) they run
side by side as upstream's do. A Neuron core runs one graph at a time, so taking turns costs the
overlap of host-side work only.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def shares_cache_between_calls(model: Any) -> bool:
    """Whether upstream keeps the KV cache it builds on the model and reuses it (4.x ``_get_cache``)."""
    get_cache = getattr(type(model), "_get_cache", None)
    if get_cache is None:
        return False
    # Past the wrappers (this plugin wraps _get_cache too) to upstream's own code.
    code = getattr(inspect.unwrap(get_cache), "__code__", None)
    return code is not None and "_cache" in code.co_names


@contextlib.contextmanager
def one_call_at_a_time(model: Any) -> Iterator[None]:
    """Hold the model's lock for one ``generate()`` call when upstream shares its cache between calls."""
    if not shares_cache_between_calls(model):
        yield
        return
    with _guard:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = threading.RLock()
    with lock:
        yield
