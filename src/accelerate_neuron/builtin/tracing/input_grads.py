"""``enable_input_require_grads``' forward hook, skipped inside a compiled graph.

PEFT and TRL call ``model.enable_input_require_grads()`` with gradient checkpointing
so that a *reentrant* checkpoint (an autograd.Function that only records a graph
when one of its inputs requires grad) still reaches the adapters. The hook calls
``output.requires_grad_(True)`` on the input embeddings' output, which Dynamo
cannot put in a graph: the embedding runs as a graph of its own, and the step
pays one more compile, launch and device->host->device hop.

Inside a compiled graph the hook has nothing to do: Dynamo traces
``torch.utils.checkpoint`` (reentrant or not) as one higher-order op and
AOTAutograd differentiates the whole graph with respect to every parameter that
requires grad, so the adapters get their gradients without it. The hook is kept
for eager calls (the CPU, ``torch_compile=False``) and skipped while Dynamo traces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _compiled_aware(hook: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def make_inputs_require_grads(module: Any, args: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return hook(module, args, output)

    make_inputs_require_grads.__wrapped__ = hook  # type: ignore[attr-defined]
    return make_inputs_require_grads


def _handles(model: Any) -> list[Any]:
    handles = getattr(model, "_require_grads_hooks", None)  # transformers >= 5: one per input embedding
    if handles:
        return list(handles)
    handle = getattr(model, "_require_grads_hook", None)  # 4.x: one
    return [handle] if handle is not None else []


def wrap_enable_input_require_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    def enable_input_require_grads(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for handle in _handles(self):
            # The hook stays where upstream registered it (same handle, same order); only its body changes.
            hooks = getattr(handle, "hooks_dict_ref", lambda: None)()
            hook = hooks.get(handle.id) if hooks is not None else None
            if hook is not None and getattr(hook, "__wrapped__", None) is None:
                hooks[handle.id] = _compiled_aware(hook)
        return result

    return enable_input_require_grads
