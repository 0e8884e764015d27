"""An instance attribute overridden for the length of a call, shared by nested and concurrent calls.

The first call installs a wrapper on the instance (over the class's attribute, or over an instance attribute
someone else set); later calls reuse it; the last one to leave restores what was there before. The caller holds
its own lock around both functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def install(obj: Any, attr: str, flag: str, build: Callable[[Any], Any]) -> Any:
    """The wrapper now at ``obj.attr`` (marked by ``flag``): the one installed, or ``build(current value)``."""
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


def uninstall(obj: Any, attr: str, wrapper: Any) -> None:
    """One user of ``wrapper`` is done; the last one puts back what :func:`install` found."""
    wrapper.users -= 1
    if wrapper.users == 0 and obj.__dict__.get(attr) is wrapper:
        if wrapper.previous is None:
            del obj.__dict__[attr]
        else:
            object.__setattr__(obj, attr, wrapper.previous)
