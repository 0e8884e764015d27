"""Which model call owns the shapes right now: at most one per context.

A ``generate()`` call (:class:`~.generation.call.GenerateCall`) or a bucketed
inference forward (:class:`~.inference.call.ForwardCall`) pads and compiles the
model calls made inside it; a model call made while one of them runs (a
sub-model, the forwards inside ``generate``) is theirs, and must not be padded a
second time. One context variable says who owns them, so threads and nested
calls each see their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_owner: contextvars.ContextVar[Any] = contextvars.ContextVar("accelerate_neuron_shape_owner", default=None)


def owner() -> Any:
    """The call that owns the model calls of this context, or None."""
    return _owner.get()


@contextlib.contextmanager
def owned_by(call: Any) -> Iterator[Any]:
    """``call`` owns the model calls made inside the block."""
    token = _owner.set(call)
    try:
        yield call
    finally:
        _owner.reset(token)
