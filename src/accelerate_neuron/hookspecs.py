"""The extension points of accelerate-neuron.

Built-in features implement these hooks exactly like third-party plugins
(entry point group ``accelerate_neuron``). For ``firstresult`` hooks the most
recently registered plugin that returns a non-``None`` value wins, and
third-party plugins are registered after the built-ins, so a third-party
implementation overrides a built-in default; ``@hookimpl(trylast=True)`` keeps
one as a fallback instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from .patching import Patch

hookspec = pluggy.HookspecMarker("accelerate_neuron")
hookimpl = pluggy.HookimplMarker("accelerate_neuron")


@hookspec
def neuron_patches() -> list[Patch]:
    """Patches this plugin contributes.

    Each is applied when its module is imported, and only on a host with a
    Neuron device (real or simulated).
    """


@hookspec(firstresult=True)
def neuron_memory_budget(index: int, total_memory: int, reserved: int, free: int | None) -> int | None:
    """Bytes ``device_map`` planning may place on visible core ``index``.

    ``free`` is ``mem_get_info``'s answer where the backend has it, else None.
    The built-in answer is ``free`` or ``total_memory - reserved`` (all free
    memory, as Accelerate plans for GPUs); return less to keep headroom for
    activations and compiled graphs. Return None to defer to the next
    implementation; a negative or non-numeric answer is ignored with a warning.
    """


@hookspec(firstresult=True)
def neuron_generation_tensor_device(name: str, model_device: torch.device) -> torch.device | str | None:
    """Where ``generate()`` keeps the growing tensor ``name`` (``input_ids``, ``attention_mask``, ...).

    Asked once per ``generate()`` call for each such tensor the caller put on
    Neuron; ``None`` or the tensor's own device leaves it where it is. The
    built-in answer is ``"cpu"``: growing tensors on the host keep the compiled
    graphs' input shapes fixed. The result returns on the caller's device.

    ``name="logits"`` asks where greedy decoding picks the next token: on the
    model's device (built-in), only one id per sequence crosses to the host;
    ``"cpu"`` copies the whole logits row every step, as upstream does.
    """


@hookspec(firstresult=True)
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    """Default ``torch.compile`` settings for ``purpose`` (``"generate"``, ``"forward"``, ``"train"``, ``"serving"``,
    ``"region"`` or ``"sampling"``).

    ``"sampling"``: the graph that processes the logits and draws the next token on the device
    (``generate()``; continuous batching samples inside its own step); its built-in answer has ``fullgraph``
    True.

    ``"region"``: one decoder layer compiled on its own (a model split over cores, or
    ``compile_regions=layers``); no answer at all turns regions off.

    ``"forward"``: the bucketed inference calls (``model(...)`` without gradients,
    pipelines, sentence-transformers). ``"serving"`` is continuous batching's step
    (``generate_batch``, ``transformers serve``); its built-in answer has
    ``fullgraph`` False: upstream keeps the paged cache's update out of the graph.

    Keys: ``backend``, ``dynamic``, ``fullgraph``, ``mode``. The built-in
    answer is ``{"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}``.
    """


@hookspec(firstresult=True)
def neuron_static_cache_length(requested: int, max_position_embeddings: int | None) -> int | None:
    """The static KV-cache length to allocate when generation asks for ``requested``.

    The built-in answer rounds up to a bucket (powers of two), so different
    prompt lengths and ``max_new_tokens`` reuse a few compiled graphs. Not
    asked when the user set the ``cache_buckets`` setting
    (``ACCELERATE_NEURON_CACHE_BUCKETS``): their choice wins.
    """


@hookspec(firstresult=True)
def neuron_generation_shape_policy(max_position_embeddings: int | None, purpose: str) -> dict[str, Any] | None:
    """Prompt-length and batch-size buckets ``generate()`` and inference calls pad to on Neuron.

    ``purpose`` is ``"generate"`` (a ``generate()`` call's prompt and batch) or
    ``"forward"`` (a bucketed inference call: an encoder's, a pipeline's,
    sentence-transformers'); an implementation may leave the argument out and
    answer for both. Returns a dict with any of ``"prompt_buckets"`` (ascending
    prompt lengths a decoder-only prompt, or an encoder input, is padded up to)
    and ``"batch_buckets"`` (ascending batch sizes the batch is padded up to with
    dummy rows); an empty list turns that bucketing off, a missing key keeps the
    built-in default: powers of two from 16 up to ``max_position_embeddings``
    (8192 if unknown), batches 1, 2, 4, ... 256 (the built-in ``inference``
    plugin answers ``"pow2-half"`` prompt buckets for ``"forward"``). Results are
    always the unpadded call's. The ``prompt_buckets`` / ``batch_buckets`` settings
    (``ACCELERATE_NEURON_PROMPT_BUCKETS`` / ``..._BATCH_BUCKETS``) the user set
    win over any plugin; ``"pow2"``, ``"pow2-half"`` and ``"off"`` are accepted as for them.
    """


@hookspec(firstresult=True)
def neuron_training_shape_policy(max_length: int | None) -> dict[str, Any] | None:
    """How training batches are padded on Neuron when the Trainer compiles.

    ``max_length`` is the longest sequence the model and tokenizer allow (None
    if unknown). Returns a dict with any of: ``"buckets"`` (lengths a batch is
    right-padded up to; empty turns bucketing off), ``"pad_to_multiple_of"``
    (for lengths beyond the last bucket), ``"drop_last"`` (default of
    ``dataloader_drop_last``), ``"pad_values"`` (batch key -> pad value, for
    keys beyond ``input_ids``/``attention_mask``/``labels``/...). Missing keys
    keep the built-in default: powers of two from 64 up to ``max_length``,
    ``drop_last=True``. The ``train_buckets`` setting the user set
    (``ACCELERATE_NEURON_TRAIN_BUCKETS``) overrides the buckets of any plugin.
    """


@hookspec(firstresult=True)
def neuron_serving_shape_policy(max_position_embeddings: int | None, kv_bytes_per_token: int) -> dict[str, Any] | None:
    """The shapes continuous batching (``generate_batch``, ``transformers serve``) compiles for on Neuron.

    ``kv_bytes_per_token`` is what one token of the model's paged KV cache
    takes (keys and values of every layer). Returns a dict with any of
    ``"token_buckets"`` (ascending query-token counts a step is padded to;
    the largest is the step's token budget), ``"kv_buckets"`` (ascending
    KV-token counts a step reads; the cache's capacity is always the last),
    ``"kv_cache_tokens"`` (the paged cache's capacity in tokens). ``"pow2"``,
    ``"pow2-half"`` and ``"off"`` are accepted as for the settings; a missing key keeps the
    built-in default (powers of two: tokens 16 ... 512, KV 512 ... capacity;
    16384 tokens of cache). The ``serving_*`` settings the user set
    (``ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS``, ...) win over any plugin.
    """
