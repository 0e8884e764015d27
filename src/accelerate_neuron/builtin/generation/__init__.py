"""Built-in plugin ``generation``: ``generate()`` on Neuron without script edits.

- One object per call (:mod:`.call`) owns what the call pads, where its
  tensors live and how its outputs come back; the patches below are thin
  adapters that ask it (:mod:`.wrappers`).
- Growing tensors (ids, attention mask, ...) stay on the host even when the
  script did ``inputs.to(model.device)``; forward inputs move to the model's
  device just before each forward; the result returns on the caller's device
  (:mod:`.devices`).
- Prompts are padded to length buckets and batches to size buckets, and the
  prefill is compiled (the shape layer :mod:`..shapes` decides the buckets;
  :mod:`.padding` is the padded layout of a call).
- Static KV cache by default, its length bucketed, and the decode step
  compiled with the ``"neuron"`` backend on every supported Transformers
  release (:mod:`.cache`).
- Greedy decoding takes the argmax on the device, and sampling runs its logits
  processors and the draw there (:mod:`.sampling`), so one id per row crosses
  to the host instead of the whole logits row.
- Threads calling ``generate()`` on one model never share a KV cache
  (:mod:`.concurrency`).

Hooks with built-in answers here: ``neuron_generation_tensor_device``,
``neuron_compile_config`` (purposes ``"generate"`` and ``"sampling"``), ``neuron_static_cache_length``.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import settings
from ...hookspecs import hookimpl
from ...patching import Patch
from . import cache, wrappers

GEN = "transformers.generation.utils"
_MIXIN = "GenerationMixin"


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        Patch(
            GEN,
            f"{_MIXIN}.generate",
            wrappers.wrap_generate,
            reason="generate() keeps growing tensors on the host, moves forward inputs to Neuron before each "
            "forward, and returns the result on the caller's device; concurrent calls on one model take turns "
            "where upstream reuses one KV cache between calls (4.x model._cache)",
            lacking="every release (>= 5.20 moves host inputs to the model, but ids put on Neuron grow there)",
            params=("inputs", "generation_config"),
        ),
        Patch(
            GEN,
            f"{_MIXIN}._prepare_text_encoder_decoder_kwargs_for_generation",
            wrappers.wrap_encoder_kwargs,
            reason="the encoder of an encoder-decoder model runs on Neuron while generate()'s ids stay on the host",
            lacking="every release",
            params=("inputs_tensor", "model_kwargs"),
            name="generation.encoder_inputs (5.x)",
        ),
        Patch(
            GEN,
            f"{_MIXIN}._prepare_encoder_decoder_kwargs_for_generation",
            wrappers.wrap_encoder_kwargs,
            reason="the encoder of an encoder-decoder model runs on Neuron while generate()'s ids stay on the host",
            lacking="every release",
            params=("inputs_tensor", "model_kwargs"),
            name="generation.encoder_inputs (4.x)",
        ),
        Patch(
            GEN,
            f"{_MIXIN}._prepare_cache_for_generation",
            wrappers.wrap_prepare_cache,
            reason="a static KV cache by default on Neuron when the caller chose none (a dynamic cache changes "
            f"shape every token); opt out with cache_implementation='dynamic' or {cache.STATIC_CACHE_ENV}=0",
            lacking="every release (DynamicCache is the default)",
            params=("generation_config", "model_kwargs", "generation_mode"),
        ),
        Patch(
            GEN,
            f"{_MIXIN}._prepare_static_cache",
            wrappers.wrap_static_cache_length,
            reason="static KV-cache length rounded up to a bucket so generate() calls share compiled graphs",
            lacking="every release",
            params=("max_cache_len",),
            name="generation.static_cache_length (5.x)",
        ),
        Patch(
            GEN,
            f"{_MIXIN}._get_cache",
            wrappers.wrap_static_cache_length,
            reason="static KV-cache length rounded up to a bucket so generate() calls share compiled graphs",
            lacking="every release",
            params=("max_cache_len",),
            name="generation.static_cache_length (4.x)",
        ),
        Patch(
            GEN,
            f"{_MIXIN}._valid_auto_compile_criteria",
            wrappers.wrap_auto_compile,
            reason="decode compiles on Neuron with a static cache, with the neuron_compile_config('generate') "
            "defaults (backend 'neuron', dynamic=False)",
            lacking="4.x (auto-compile is CUDA-only and defaults to inductor/reduce-overhead)",
            params=("model_kwargs", "generation_config"),
        ),
        Patch(
            GEN,
            f"{_MIXIN}._sample",
            wrappers.wrap_sample,
            reason="greedy decoding takes the argmax on Neuron, and sampling runs its logits processors and the draw "
            "there: one id per row crosses to the host, not the logits",
            lacking="every release",
            params=("input_ids", "logits_processor", "generation_config"),
        ),
        Patch(
            GEN,
            f"{_MIXIN}._assisted_decoding",
            wrappers.wrap_assisted_decoding,
            reason="assisted generation and prompt lookup on Neuron run the draft and the target compiled at a few "
            "widths, each on a static KV cache rolled back by position, with the sequence on the host "
            f"({settings.env_name('speculation')}=0 opts out)",
            lacking="every release (a dynamic cache cropped every round, the sequence on the model's device: new op "
            "shapes every token)",
            params=("input_ids", "logits_processor", "stopping_criteria", "generation_config"),
        ),
        Patch(
            "transformers.modeling_utils",
            "PreTrainedModel.get_compiled_call",
            wrappers.wrap_get_compiled_call,
            reason="the compiled decode step hands back the greedy token when _sample selects it on Neuron; with "
            "compiled regions (a model split over cores) the model's own call runs, its decoder layers compiled",
            lacking="every release",
            params=("compile_config",),
        ),
    ]


@hookimpl
def neuron_generation_tensor_device(name: str, model_device: torch.device) -> torch.device | str | None:
    # "logits" is where the next token is picked (greedy): on the device, so
    # only the ids cross. Everything else generate() grows lives on the host.
    if name == "logits":
        return model_device
    return "cpu"


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose == "sampling":  # the logits processors and the draw: plain tensor arithmetic, one graph
        return {"backend": "neuron", "dynamic": False, "fullgraph": True, "mode": None}
    if purpose != "generate":
        return None
    return {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}


@hookimpl
def neuron_static_cache_length(requested: int, max_position_embeddings: int | None) -> int | None:
    # The user's cache_buckets (environment, config file) is applied before any plugin is asked.
    return cache.bucket_length(requested, max_position_embeddings, settings.setting("cache_buckets").default)


@hookimpl
def neuron_generation_shape_policy(max_position_embeddings: int | None, purpose: str) -> dict[str, Any] | None:
    if purpose != "generate":  # inference calls: the inference plugin's answer
        return None
    return {"prompt_buckets": settings.POW2, "batch_buckets": settings.POW2}
