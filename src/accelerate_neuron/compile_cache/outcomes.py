"""What this process's compile cache lookups came to, and labels naming what is being compiled.

The counts feed ``accelerate-neuron precompile``'s progress (graphs compiled, fetched from the remote cache,
loaded from the local one); the labels (set by the warm-up around each shape: the job, the model, the bucket)
go into each entry, so ``accelerate-neuron cache ls`` can say which job, model and bucket made it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

#: Lookup sources: "compiled" (a miss), "remote" (fetched from the remote cache), "disk", "memory".
_counts: Counter[str] = Counter()
_lock = threading.Lock()
_labels: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("compile_cache_labels", default=None)


def record(source: str) -> None:
    """Count one graph lookup that ended in ``source``."""
    with _lock:
        _counts[source] += 1


def snapshot() -> dict[str, int]:
    """Graph lookups since the process started (or :func:`reset`), by source."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()


@contextlib.contextmanager
def labelled(**labels: Any) -> Iterator[None]:
    """Entries compiled inside the block carry ``labels`` (e.g. ``model=..., bucket=...``) under ``made_by``."""
    token = _labels.set({**(_labels.get() or {}), **labels})
    try:
        yield
    finally:
        _labels.reset(token)


def labels() -> dict[str, Any]:
    return dict(_labels.get() or {})
