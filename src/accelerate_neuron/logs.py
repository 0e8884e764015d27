"""Say it once: warnings and notes that would otherwise repeat on every call.

Every module logs through ``logging.getLogger(__name__)``: a child of the
``accelerate_neuron`` logger, whose level ``ACCELERATE_NEURON_LOG_LEVEL`` sets
(:func:`apply_level`, at activation).
A message that would repeat on every call (a bucket the prompt outgrew, the
first padded call, a collator left alone) goes through :func:`once`, keyed by
what it is about; :func:`forget` lets a test hear it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

ROOT = "accelerate_neuron"

_seen: set[Hashable] = set()
_lock = threading.Lock()


def first(key: Hashable) -> bool:
    """True the first time ``key`` is seen in this process (thread-safe), then False."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def once(logger: logging.Logger, key: Hashable, message: str, *args: object, level: int = logging.WARNING) -> bool:
    """Log ``message`` the first time ``key`` is seen; returns whether it was logged."""
    if not first(key):
        return False
    logger.log(level, message, *args)
    return True


def forget(prefix: Hashable | None = None) -> None:
    """Forget what was said (all, or the keys that are tuples starting with ``prefix``): tests hear it again."""
    with _lock:
        if prefix is None:
            _seen.clear()
        else:
            _seen.difference_update({k for k in _seen if k == prefix or (isinstance(k, tuple) and k[:1] == (prefix,))})


def apply_level() -> None:
    """Set the ``accelerate_neuron`` logger's level from ``ACCELERATE_NEURON_LOG_LEVEL`` (a bad value: unchanged)."""
    from . import settings

    try:
        level = settings.get("log_level")
    except ValueError as exc:
        logging.getLogger(ROOT).warning("accelerate_neuron: %s", exc)
        return
    if level:
        logging.getLogger(ROOT).setLevel(level)
