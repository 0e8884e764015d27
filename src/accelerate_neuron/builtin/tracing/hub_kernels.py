"""The ``kernels`` package's per-call context, kept out of compiled graphs when it selects nothing.

Transformers 5 decorates attention classes with ``kernels.use_kernelized_func``: every
``forward`` then sets and resets a module-global ``CompileableContextVar``
(``_ACTIVE_KERNEL_FUNCS``) naming the hub kernel each function should run. While
Dynamo traces, that ``set`` assigns attributes of a global object. Inside
``torch.utils.checkpoint`` (gradient checkpointing: TRL's default, or
``gradient_checkpointing=True``) such a side effect is refused, and each decoder
layer breaks the graph: one more graph per layer per step, each layer's
attention run between compiled pieces.

On Neuron no hub kernel exists (the mappings are CUDA, ROCm and XPU), so the
context only ever says "use the function itself", which is what the kernelized
function does when nothing is active. While compiling, a ``set`` whose value
selects no kernel (and that would not shadow an active one) is skipped and its
``reset`` too: the traced function is the same, without the side effect. Eager
calls, and a model a user did kernelize, keep upstream's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The token a skipped ``set`` returns; its ``reset`` does nothing.
SKIPPED = object()


def _selects_nothing(value: Any) -> bool:
    """True when no entry of ``value`` ({id(fn): (kernel module, forward)}) replaces the function's own forward."""
    if not isinstance(value, dict):
        return False
    for entry in value.values():
        kernel_func, forward_func = entry
        if forward_func is not type(kernel_func).forward:
            return False
    return True


def wrap_set(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def set(self: Any, value: Any) -> Any:
        if (
            torch.compiler.is_compiling()
            and not self.uses_global_var
            and self.global_var is None
            and _selects_nothing(value)
        ):
            return SKIPPED
        return original(self, value)

    return set


def wrap_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset(self: Any, token: Any) -> Any:
        if token is SKIPPED:
            return None
        return original(self, token)

    return reset


def needed(original: Any) -> str | None:
    """The patch relies on the context's two attributes; without them upstream changed its design."""
    module = __import__(original.__module__, fromlist=["CompileableContextVar"])
    probe = module.CompileableContextVar("accelerate_neuron_probe")
    if not hasattr(probe, "global_var") or not hasattr(probe, "uses_global_var"):
        return "CompileableContextVar no longer keeps global_var / uses_global_var: upstream changed its design"
    return None
