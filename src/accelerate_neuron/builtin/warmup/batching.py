"""``generate_batch()`` in a warm-up: continuous batching's warm-up over every step shape, then a stand-in result.

Continuous batching on Neuron warms its whole grid of step shapes (query-token
bucket x KV bucket, see :mod:`accelerate_neuron.builtin.serving.steps`), each
shape claimed through the session so ``--jobs N`` splits them. In a warm-up,
``generate_batch`` runs that warm-up only (through upstream's own context
manager, which builds, warms, starts and stops the manager as the real call
does) and returns, for each input, a finished result of ``max_new_tokens`` pad
tokens, so the script carries on. ``init_continuous_batching().warmup()``, what
``transformers serve`` runs at start, needs nothing here: its warm-up is the
same claimed one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .. import precompile_session as session
from ..model_devices import model_device
from .generation import filler_id


def wrap_generate_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        if session.current() is None or model_device(self) is None:
            return original(self, *args, **kwargs)
        from transformers.generation.continuous_batching import RequestStatus
        from transformers.generation.continuous_batching.requests import GenerationOutput

        arguments = signature.bind(self, *args, **kwargs).arguments
        inputs = arguments.get("inputs") or []
        if not inputs:
            return {}
        config = arguments.get("generation_config") or self.generation_config
        new = (arguments.get("kwargs") or {}).get("max_new_tokens", getattr(config, "max_new_tokens", None)) or 0
        with self.continuous_batching_context_manager(
            generation_config=arguments.get("generation_config"),
            continuous_batching_config=arguments.get("continuous_batching_config"),
            block=True,
            timeout=5,
            warmup=True,
        ):
            pass
        pad = filler_id(config)
        return {
            f"req_{i}": GenerationOutput(
                request_id=f"req_{i}",
                prompt_ids=list(ids),
                generated_tokens=[pad] * new,
                status=RequestStatus.FINISHED,
            )
            for i, ids in enumerate(inputs)
        }

    return generate_batch
