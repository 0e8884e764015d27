"""An instance attribute overridden for the length of a call, shared by nested and concurrent calls.

The first call installs a wrapper on the instance (over the class's attribute, or over an instance attribute
someone else set); later calls reuse it; the last one to leave restores what was there before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Installs and uninstalls of every caller, one at a time (a user count changes under it).
_lock = threading.Lock()


@contextlib.contextmanager
def overridden(obj: Any, attr: str, flag: str, build: Callable[[Any], Any]) -> Iterator[Any]:
    """``obj.attr`` replaced for the ``with`` block by the wrapper marked ``flag``: the one already installed, or
    ``build(current value)``; the last block to leave puts back what it found. Yields the wrapper."""
    with _lock:
        wrapper = _install(obj, attr, flag, build)
    try:
        yield wrapper
    finally:
        with _lock:
            _uninstall(obj, attr, wrapper)


def _install(obj: Any, attr: str, flag: str, build: Callable[[Any], Any]) -> Any:
    existing = obj.__dict__.get(attr)
    if getattr(existing, flag, False):
        wrapper = existing
    else:
        wrapper = build(getattr(obj, attr))
        setattr(wrapper, flag, True)
        wrapper.users = 0
        wrapper.previous = existing  # None: the class's attribute (no instance attribute)
        object.__setattr__(obj, attr, wrapper)  # past nn.Module.__setattr__, which would register it
    wrapper.users += 1
    return wrapper


def _uninstall(obj: Any, attr: str, wrapper: Any) -> None:
    wrapper.users -= 1
    if wrapper.users == 0 and obj.__dict__.get(attr) is wrapper:
        if wrapper.previous is None:
            del obj.__dict__[attr]
        else:
            object.__setattr__(obj, attr, wrapper.previous)
