"""Static KV cache and compiled decode for ``generate()`` on Neuron.

Every new input shape of a compiled graph is a new Neuron compile (minutes),
and a ``DynamicCache`` grows by one position per token. So on Neuron:

- the KV cache is static by default when the caller chose none
  (``ACCELERATE_NEURON_STATIC_CACHE=0`` or ``cache_implementation="dynamic"``
  opts out);
- its length is rounded up to a bucket (the ``cache_buckets`` setting, or a
  plugin's ``neuron_static_cache_length`` answer), so different prompt lengths
  and ``max_new_tokens`` reuse a few graphs;
- the decode step is compiled with the ``neuron_compile_config("generate")``
  settings on every Transformers release (4.57 only auto-compiles on CUDA and
  defaults to inductor); ``disable_compile=True`` and a caller's
  ``compile_config`` are honoured.

The decisions are here; :mod:`.wrappers` applies them to upstream's calls.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ... import logs, settings
from ...plugins import call_hook
from ..compile_options import compile_config
from ..shapes import Buckets, max_positions, note, pow2, record_key, round_up_pow2, round_up_pow2_half
from ..shapes.record import fitted_buckets
from .devices import split_across_devices

logger = logging.getLogger(__name__)

STATIC_CACHE_ENV = settings.env_name("static_cache")
BUCKETS_ENV = settings.env_name("cache_buckets")
#: Smallest power-of-two bucket: shorter caches cost next to nothing and would add graphs.
MIN_POW2_BUCKET = 64
#: Without a known context length, ``fit``'s catch-all cache bucket.
DEFAULT_MAX_CACHE = 8192
# Greedy/sampling/beam loops work with a static cache on both supported
# releases; assisted and contrastive decoding roll the cache back (dynamic only).
_STATIC_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})


def static_cache_default_enabled() -> bool:
    """The ``static_cache`` setting."""
    return settings.get("static_cache")


def parse_buckets(raw: str | None) -> settings.BucketSpec:
    """The ``cache_buckets`` value for the text ``raw``: ``"pow2"`` (also when unset), ``()`` (off) or lengths."""
    if raw is None or not raw.strip():
        return settings.POW2
    return settings.parse("cache_buckets", raw)


def bucket_length(requested: int, max_position_embeddings: int | None, spec: settings.BucketSpec) -> int:
    """The cache length for ``requested`` positions under the bucket list ``spec``."""
    if not spec or spec == "off" or requested <= 0:
        return requested
    if spec == settings.POW2:
        length = round_up_pow2(requested, MIN_POW2_BUCKET)
    elif spec == settings.POW2_HALF:
        length = round_up_pow2_half(requested, MIN_POW2_BUCKET)
    else:
        length = Buckets(spec, "cache_buckets").pad_to(requested, "generate()", "KV-cache length")
    # Never beyond what the model can address, unless the request itself is.
    if max_position_embeddings and length > max_position_embeddings >= requested:
        length = max_position_embeddings
    return length


def cache_length(model: Any, requested: int) -> int:
    """The static cache length to allocate for ``requested`` positions: the ``cache_buckets`` setting's answer.

    A bucket list the user chose (environment, config file) wins over any plugin; otherwise the
    ``neuron_static_cache_length`` hook answers (built-in: powers of two).
    """
    limit = max_positions(model)
    record = record_key(model)
    note(record, "cache_buckets", requested)
    chosen = settings.explicit("cache_buckets")
    if chosen is not None and chosen.value == settings.FIT:
        fitted = fitted_buckets(record, "cache_buckets", lambda: pow2(MIN_POW2_BUCKET, limit or DEFAULT_MAX_CACHE))
        return bucket_length(requested, limit, fitted)
    if chosen is not None:
        return bucket_length(requested, limit, chosen.value)
    answer = call_hook("neuron_static_cache_length", requested=requested, max_position_embeddings=limit)
    if answer is None:
        return requested
    if isinstance(answer, bool) or not isinstance(answer, int) or not requested <= answer <= settings.MAX_BUCKET:
        raise ValueError(
            f"neuron_static_cache_length returned {answer!r} for a request of {requested}: expected an int from "
            f"{requested} to {settings.MAX_BUCKET}"
        )
    return answer


def initialize_before_compiled_prefill(model: Any, cache: Any, batch_size: Any) -> None:
    """Allocate a fresh static cache before the compiled prefill (4.x initialises it lazily, inside the graph).

    A cache allocated inside the first compiled prefill makes that graph differ from the next call's (the
    cache then exists): one prefill graph per bucket would become two. Transformers 5.x does this itself.
    An encoder-decoder cache has two parts (self- and cross-attention), each initialised the same way.
    """
    parts = (
        (cache.self_attention_cache, cache.cross_attention_cache)
        if hasattr(cache, "cross_attention_cache") and hasattr(cache, "self_attention_cache")
        else (cache,)
    )
    for part in parts:
        _initialize(model, part, batch_size, encoder_decoder=len(parts) == 2)


def _initialize(model: Any, cache: Any, batch_size: Any, encoder_decoder: bool) -> None:
    layers = getattr(cache, "layers", None)
    if not isinstance(batch_size, int) or not layers or all(getattr(x, "is_initialized", True) for x in layers):
        return
    early = getattr(cache, "early_initialization", None)
    shape = _head_shape(model)
    if not callable(early) or shape is None:
        return
    try:
        if split_across_devices(model):
            if not encoder_decoder:
                _initialize_on_layer_devices(model, layers, batch_size, shape)
        else:
            early(batch_size=batch_size, num_heads=shape[0], head_dim=shape[1], dtype=model.dtype, device=model.device)
    except Exception as exc:  # lazy initialisation still works: one more prefill graph at worst
        logger.debug("accelerate_neuron: could not initialise the static cache ahead of the prefill: %s", exc)


def _initialize_on_layer_devices(model: Any, cache_layers: Any, batch_size: int, shape: tuple[int, int]) -> None:
    """Each cache layer on the core of its decoder layer (a model split over cores; what 4.x's lazy init picks)."""
    from ..layer_regions import blocks

    decoder_layers = blocks(model)
    if len(decoder_layers) != len(cache_layers):
        return  # not one cache layer per decoder layer: leave it to the lazy initialisation
    for cache_layer, decoder_layer in zip(cache_layers, decoder_layers, strict=True):
        device = next(decoder_layer.parameters()).device
        # Upstream's own fake tensor (early_initialization): size 0 on the sequence axis, allocates nothing.
        fake = torch.zeros((batch_size, shape[0], 0, shape[1]), dtype=model.dtype, device=device)
        cache_layer.lazy_initialization(fake)


def _head_shape(model: Any) -> tuple[int, int] | None:
    """(KV heads, head dim) of the decoder's attention, as a static cache stores them; None if not one shape."""
    own = getattr(model, "_get_static_cache_init_shape", None)
    if callable(own):  # upstream's own answer where it has one (tensor parallel, MLA, ...)
        shape = own()
        return shape if shape is not None and all(isinstance(v, int) for v in shape) else None
    try:
        config = model.config.get_text_config(decoder=True)
    except Exception:
        config = getattr(model, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    # T5 names its head size d_kv. An encoder-decoder's decoder view (get_text_config) maps the decoder's
    # own names (decoder_attention_heads, ...) onto these.
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
    if head_dim is None and isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int):
        head_dim = config.hidden_size // config.num_attention_heads
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return None
    return heads, head_dim


def mode_name(generation_mode: Any) -> str:
    return str(getattr(generation_mode, "value", generation_mode))


def _caller_chose_cache(generation_config: Any, model_kwargs: dict[str, Any]) -> bool:
    if getattr(generation_config, "cache_implementation", None) is not None:
        return True
    if getattr(generation_config, "use_cache", True) is False:
        return True
    return any(model_kwargs.get(k) is not None for k in ("past_key_values", "cache", "cache_params"))


def _supports_static_cache(model: Any) -> bool:
    if not getattr(model, "_can_compile_fullgraph", False):
        return False
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    try:
        return bool(supports()) if callable(supports) else False
    except Exception:
        return False


def choose_static_cache(model: Any, generation_config: Any, model_kwargs: dict[str, Any], mode: str) -> None:
    """A static cache for this call when the caller chose none and the model and mode can use one."""
    if (
        not _caller_chose_cache(generation_config, model_kwargs)
        and mode in _STATIC_MODES
        and not getattr(generation_config, "is_assistant", False)
        and _supports_static_cache(model)
        and static_cache_default_enabled()
    ):
        generation_config.cache_implementation = "static"
        logs.once(
            logger,
            "generation.static_cache",
            "accelerate_neuron: generate() on Neuron uses a static KV cache (length rounded up to a bucket, see %s) "
            "so the decode step compiles once instead of once per token. Opt out with "
            "cache_implementation='dynamic' or %s=0.",
            BUCKETS_ENV,
            STATIC_CACHE_ENV,
        )


# --- compiled decode ------------------------------------------------------------------------------


def _compileable_cache(model_kwargs: dict[str, Any]) -> bool:
    """Upstream's own cache criterion for auto-compile: a compileable cache that is not a DynamicCache."""
    cache = next((model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None), None)
    decoder = getattr(cache, "self_attention_cache", cache)
    return bool(getattr(cache, "is_compileable", False)) and type(decoder).__name__ != "DynamicCache"


def _warn_split_model() -> None:
    logs.once(
        logger,
        "generation.split_model",
        "accelerate_neuron: generate() does not auto-compile a model dispatched across several Neuron cores: "
        "its decode step would be one graph holding tensors of several cores, and a NEFF runs on one NeuronCore "
        "(torch-neuronx's support for such graphs is unverified). Decode runs eagerly with a static cache "
        "instead, because %s=off; its default (auto) compiles each decoder layer on its own core.",
        settings.env_name("compile_regions"),
    )


def compile_config_for(model: Any, model_kwargs: dict[str, Any], generation_config: Any, regional: bool = False) -> Any:
    """The compile config ``_valid_auto_compile_criteria`` should see for a model on Neuron.

    ``None``: leave upstream's decision alone (nothing to compile, or compiling disabled); ``False``: do not
    compile (a model split across cores, without regions); ``regional``: the decoder layers are what compiles
    (:mod:`..regions`), so a split model is fine; else the caller's config (copied) or Neuron's defaults, with
    upstream's own flag that lets 4.x compile on a device other than CUDA.
    """
    if getattr(generation_config, "disable_compile", False):
        return None
    config = getattr(generation_config, "compile_config", None)
    if config is None and not _compileable_cache(model_kwargs):
        # Nothing to compile (e.g. a dynamic cache): adding a config would only make upstream
        # warn that it cannot honour it.
        return None
    if config is None and split_across_devices(model) and not regional:
        _warn_split_model()
        return False
    if config is None:
        config = compile_config("generate")
    elif not getattr(config, "_compile_all_devices", None):
        config = copy.copy(config)  # the caller's object stays as they made it
    config._compile_all_devices = True
    return config


#: Attribute beside upstream's ``_compiled_call`` where :func:`compile_refused_family` keeps its compiled call.
_OWN_COMPILED = "_accelerate_neuron_compiled_call"


def compile_refused_family(model: Any, given: Any) -> Any:
    """The model's call compiled with ``given`` (a ``CompileConfig``; None: the generate defaults), for a family
    whose ``get_compiled_call`` returns the uncompiled call (Llama 4 on every supported release: "TODO ... HYBRID
    CACHE SUPPORT").

    Upstream's reason is its own hybrid chunked cache; on Neuron the cache is static (chunked layers included),
    and the decode step compiled over it gives the CPU's tokens (tests/test_families.py, llama4_text), while
    eager decoding costs every op of the step as its own eager compile. Kept like upstream's ``_compiled_call``:
    one per model and config.
    """
    config = given or compile_config("generate")
    kept = getattr(model, _OWN_COMPILED, None)
    if kept is None or kept[0] != config:
        kept = (config, torch.compile(model.__call__, **config.to_dict()))
        setattr(model, _OWN_COMPILED, kept)
    return kept[1]
