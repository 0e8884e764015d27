"""torch.compile for training on Neuron: the settings, and ``dynamic=False`` in Accelerate's plugin.

Every new input shape of a compiled graph is a new Neuron compile, and the
Neuron backend cannot compile graphs with symbolic shapes, so training
compiles with ``dynamic=False``. Transformers >= 5 passes that from the
Trainer; Accelerate's own ``TorchDynamoPlugin`` (``Accelerator(dynamo_backend=
"neuron")``, ``accelerate launch --dynamo_backend``, Transformers 4.x's
``ACCELERATE_DYNAMO_*`` environment) leaves ``dynamic`` unset in every
release, which lets Dynamo turn a recompiled dimension symbolic.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_CONFIG: dict[str, Any] = {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}
_KEYS = {"backend": (str,), "dynamic": (bool, type(None)), "fullgraph": (bool,), "mode": (str, type(None))}
DYNAMO_ENV = "ACCELERATE_DYNAMO_USE_DYNAMIC"


def train_compile_config() -> dict[str, Any]:
    """``neuron_compile_config(purpose="train")`` over the built-in defaults, validated."""
    from ...plugins import call_hook

    answer = call_hook("neuron_compile_config", purpose="train")
    if answer is None:
        return dict(DEFAULT_CONFIG)
    if not isinstance(answer, dict):
        raise TypeError(f"neuron_compile_config(purpose='train') returned {answer!r}; expected a dict or None")
    unknown = sorted(set(answer) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"neuron_compile_config(purpose='train') returned unknown key(s) {unknown}; allowed: {sorted(_KEYS)}"
        )
    for key, value in answer.items():
        if not isinstance(value, _KEYS[key]):
            allowed = " or ".join(t.__name__ for t in _KEYS[key])
            raise TypeError(f"neuron_compile_config(purpose='train')[{key!r}] = {value!r}; expected {allowed}")
    return {**DEFAULT_CONFIG, **answer}


def _is_neuron_backend(backend: Any) -> bool:
    value = getattr(backend, "value", backend)
    return isinstance(value, str) and value.lower() == "neuron"


def wrap_dynamo_post_init(original: Any) -> Any:
    def __post_init__(self: Any) -> None:
        original(self)
        # Only an unset ``dynamic`` (field None and no ACCELERATE_DYNAMO_USE_DYNAMIC) gets the default.
        if self.dynamic is None and _is_neuron_backend(self.backend) and DYNAMO_ENV not in os.environ:
            self.dynamic = train_compile_config()["dynamic"]

    return __post_init__


def dynamo_needed(_original: Any) -> str | None:
    from accelerate.utils.dataclasses import DynamoBackend, TorchDynamoPlugin

    if "NEURON" not in DynamoBackend.__members__:
        return None  # the backfilled member arrives with the enum patches
    saved = os.environ.pop(DYNAMO_ENV, None)
    try:
        probe = TorchDynamoPlugin(backend="neuron")
    finally:
        if saved is not None:
            os.environ[DYNAMO_ENV] = saved
    if probe.dynamic is False:
        return "upstream TorchDynamoPlugin already compiles the neuron backend with dynamic=False"
    return None
