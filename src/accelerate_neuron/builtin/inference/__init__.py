"""Built-in plugin ``inference``: every inference call of a model on Neuron sees few shapes.

A Transformers model called without gradients (``model(**batch)`` under
``torch.no_grad()``, every ``pipeline``) and a sentence-transformers model
(``encode``, ``predict``, ``rank``) pad their token inputs to length and batch
buckets, run compiled with the ``"neuron"`` backend, and give back outputs cut
to the caller's shapes (:mod:`.call`, :mod:`.outputs`). ``generate()`` keeps
its own bucketing: the forwards inside it are its own (:mod:`..scope`).

Hooks with a built-in answer here: ``neuron_compile_config`` and
``neuron_generation_shape_policy`` (purpose ``"forward"``: ``pow2-half`` length
buckets, ``pow2`` batch buckets; the user's ``prompt_buckets`` / ``batch_buckets``
win).
"""

from __future__ import annotations

from typing import Any

from ... import settings
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
def neuron_generation_shape_policy(max_position_embeddings: int | None, purpose: str) -> dict[str, Any] | None:
    if purpose != "forward":
        return None
    # Two length buckets an octave, not generate()'s one: a forward computes every padded position on every call,
    # with no decode to spread its prefill over. On 256 embedding texts that is 1.33 positions per real one
    # instead of 1.55 (reranking 1.26 instead of 1.53) for 22 graphs instead of 16, compiled once and cached
    # (benchmarks/inference.py). Batches stay powers of two: the row groups already fill them.
    return {"prompt_buckets": settings.POW2_HALF, "batch_buckets": settings.POW2}


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "forward":
        return None
    return {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}
