"""``torch.compile`` keyword arguments from a ``neuron_compile_config`` answer, checked the same way for every
purpose (``generate``, ``forward``, ``region``, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEYS = ("backend", "dynamic", "fullgraph", "mode", "options")


def compile_options(answer: Mapping[str, Any], purpose: str) -> dict[str, Any]:
    """``answer`` checked and completed: an unknown key is an error naming it; ``None`` values are dropped (but an
    explicit ``dynamic=None``, which means "let Dynamo decide"); ``mode`` defaults to ``"default"``."""
    unknown = sorted(set(answer) - set(KEYS))
    if unknown:
        raise ValueError(
            f"neuron_compile_config returned unknown key(s) {unknown} for {purpose!r}; allowed: {list(KEYS)}"
        )
    values = {k: v for k, v in answer.items() if v is not None or k == "dynamic"}
    values.setdefault("mode", "default")  # torch.compile passes any other mode to a non-inductor backend
    return values


def compile_config(purpose: str) -> Any:
    """Transformers' ``CompileConfig`` from the ``neuron_compile_config`` hook's answer for ``purpose`` (generate()'s
    decode step, continuous batching's step)."""
    from transformers.generation.configuration_utils import CompileConfig

    from ..plugins import call_hook

    return CompileConfig(**compile_options(call_hook("neuron_compile_config", purpose=purpose) or {}, purpose))
