"""Transformers' ``logger.warning_once`` calls, skipped while Dynamo traces instead of breaking the graph.

Dynamo cannot put a ``logging.Logger`` method call in a graph: it breaks there
unless the method is in ``torch._dynamo.config.ignore_logger_methods``. Transformers
4.57 warns once from inside every decoder forward it wraps (``use_cache=True`` is
incompatible with gradient checkpointing): a compiled training step with gradient
checkpointing breaks at that line on every step.

The patch puts a ``Logger.warning_once`` that calls upstream's into that set:
eager calls still warn once; a call Dynamo traces is skipped (a one-time advice,
which the first eager call, or the CPU run, gives anyway). Reverting the patch
restores upstream's method; the set then holds a function nothing calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrap_warning_once(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch._dynamo.config

    def warning_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    torch._dynamo.config.ignore_logger_methods.add(warning_once)
    return warning_once
