"""Built-in plugin ``inference``: every inference call of a model on Neuron sees few shapes.

A Transformers model called without gradients (``model(**batch)`` under
``torch.no_grad()``, every ``pipeline``) and a sentence-transformers model
(``encode``, ``predict``, ``rank``) pad their token inputs to length and batch
buckets, run compiled with the ``"neuron"`` backend, and give back outputs cut
to the caller's shapes (:mod:`.call`, :mod:`.outputs`). ``generate()`` keeps
its own bucketing: the forwards inside it are its own (:mod:`..scope`).

Hook with a built-in answer here: ``neuron_compile_config`` (purpose ``"forward"``).
The buckets are ``neuron_generation_shape_policy``'s (``prompt_buckets``,
``batch_buckets``).
"""

from __future__ import annotations

from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch
from . import call

_WHY = (
    "an inference call on Neuron (no gradients, eval mode) pads its token inputs to length and batch buckets and "
    "runs compiled, so new lengths reuse a few graphs; outputs are cut back to the caller's shapes"
)


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        Patch(
            "transformers.modeling_utils",
            "PreTrainedModel.__call__",
            call.wrap_model_call,
            reason=f"model(...), pipelines: {_WHY}",
            lacking="every release (a new graph or new eager compiles for every input shape)",
        ),
        Patch(
            "sentence_transformers.base.model",
            "BaseModel.__call__",
            call.wrap_sentence_transformer_call,
            reason=f"SentenceTransformer.encode, CrossEncoder.predict/rank, SparseEncoder: {_WHY}; the module chain "
            "(transformer, pooling, normalisation, score head) is one compiled call",
            lacking="every release",
            gone="sentence-transformers < 5 has no BaseModel: its Transformer module's model call is bucketed instead",
        ),
    ]


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "forward":
        return None
    return {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}
