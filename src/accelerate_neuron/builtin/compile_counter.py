"""Counting the frames Dynamo compiles in this process, for code that must say whether a call compiled.

The recompile watchdog (training) and continuous batching's post-warm-up
warning (serving) both ask "did this call start a compile?". Compiles are
counted with Dynamo's compile-start callbacks
(``torch._dynamo.callback.callback_handler``, trigger ``DYNAMO``: backward
graphs follow the forward they belong to), falling back to Dynamo's
``unique_graphs`` counter where a torch lacks them. It needs nothing from the
backend: it works on real hardware and on the simulator alike.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_dynamo_compiles = 0


def _on_compile_start(args: Any) -> None:
    global _dynamo_compiles
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    if trigger == "DYNAMO":  # backward graphs follow the forward they belong to
        with _lock:
            _dynamo_compiles += 1


def _callback_handler() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except Exception:
        return None
    return callback_handler if hasattr(callback_handler, "register_start_callback") else None


def ensure_compile_counter() -> bool:
    """(Re)register the compile-start callback; ``torch._dynamo.reset()`` drops callbacks."""
    handler = _callback_handler()
    if handler is None:
        return False
    callbacks = getattr(handler, "start_callbacks", None)
    if callbacks is None or _on_compile_start not in callbacks:
        handler.register_start_callback(_on_compile_start)
    return True


def compile_count() -> int:
    """Dynamo frame compiles started in this process (as far as the callback has seen)."""
    if _callback_handler() is not None:
        return _dynamo_compiles
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return 0
