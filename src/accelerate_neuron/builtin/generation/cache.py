"""Static KV cache and compiled decode for ``generate()`` on Neuron.

Every new input shape of a compiled graph is a new Neuron compile (minutes),
and a ``DynamicCache`` grows by one position per token. So on Neuron:

- the KV cache is static by default when the caller chose none
  (``ACCELERATE_NEURON_STATIC_CACHE=0`` or ``cache_implementation="dynamic"``
  opts out);
- its length is rounded up to a bucket (``neuron_static_cache_length`` hook;
  ``ACCELERATE_NEURON_CACHE_BUCKETS``), so different prompt lengths and
  ``max_new_tokens`` reuse a few graphs;
- the decode step is compiled with the ``neuron_compile_config("generate")``
  settings on every Transformers release (4.57 only auto-compiles on CUDA and
  defaults to inductor); ``disable_compile=True`` and a caller's
  ``compile_config`` are honoured.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from ...plugins import call_hook
from . import bucketing, padding, shapes
from .devices import model_device, split_across_devices

logger = logging.getLogger("accelerate_neuron")

STATIC_CACHE_ENV = "ACCELERATE_NEURON_STATIC_CACHE"
BUCKETS_ENV = "ACCELERATE_NEURON_CACHE_BUCKETS"
#: Smallest power-of-two bucket: shorter caches cost next to nothing and would add graphs.
MIN_POW2_BUCKET = 64
# Greedy/sampling/beam loops work with a static cache on both supported
# releases; assisted and contrastive decoding roll the cache back (dynamic only).
_STATIC_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})

_announced = False


def static_cache_default_enabled() -> bool:
    raw = os.environ.get(STATIC_CACHE_ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid {STATIC_CACHE_ENV}={raw!r}: expected 1 (default: static KV cache on Neuron) or 0")


def parse_buckets(raw: str | None) -> str | tuple[int, ...]:
    """``"pow2"`` (default), ``"off"``, or an ascending tuple of lengths from ``"256,512,1024"``."""
    parsed = shapes.parse_buckets(raw, BUCKETS_ENV, "cache lengths", example="256,512,1024")
    if parsed is None or parsed == "pow2":
        return "pow2"
    return parsed or "off"


_warned_beyond: set[int] = set()


def bucket_length(requested: int, max_position_embeddings: int | None, spec: str | tuple[int, ...]) -> int:
    """The built-in answer of ``neuron_static_cache_length``."""
    if spec == "off" or requested <= 0:
        return requested
    if spec == "pow2":
        length = max(MIN_POW2_BUCKET, 1 << (requested - 1).bit_length())
    else:
        length = next((n for n in spec if n >= requested), requested)
        if length == requested and requested not in spec and requested not in _warned_beyond:
            _warned_beyond.add(requested)
            logger.warning(
                "accelerate_neuron: generate() needs a KV cache of %d positions, more than the largest bucket in "
                "%s=%s; this length gets its own compiled graph. Add a larger bucket.",
                requested,
                BUCKETS_ENV,
                ",".join(map(str, spec)),
            )
    # Never beyond what the model can address, unless the request itself is.
    if max_position_embeddings and length > max_position_embeddings >= requested:
        length = max_position_embeddings
    return length


def cache_length(model: Any, requested: int) -> int:
    answer = call_hook(
        "neuron_static_cache_length", requested=requested, max_position_embeddings=bucketing.max_positions(model)
    )
    if answer is None:
        return requested
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < requested:
        raise ValueError(
            f"neuron_static_cache_length returned {answer!r} for a request of {requested}: expected an int >= "
            f"{requested}"
        )
    return answer


def wrap_static_cache_length(original: Callable[..., Any]) -> Callable[..., Any]:
    """For ``_get_cache`` (Transformers 4.x) and ``_prepare_static_cache`` (5.x): bucket the cache's shape.

    Its length holds the prompt's pad slots, then rounds up to a cache bucket; its
    batch is the plan's batch bucket (dummy rows) when the call may use one.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sized(self: Any, *args: Any, **kwargs: Any) -> Any:
        if model_device(self) is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        plan = padding.current()
        batch = bound.arguments.get("batch_size")
        if plan is not None and isinstance(batch, int):
            plan.batch = batch
            if plan.may_add_rows:
                bucket = plan.policy.batch_bucket(batch)
                if bucket is None:
                    shapes.warn_beyond_largest("batch size", batch, plan.policy.batch_buckets, shapes.BATCH_BUCKETS_ENV)
                else:
                    plan.dummy = bucket - batch
                    bound.arguments["batch_size"] = bucket
        requested = bound.arguments.get("max_cache_len")
        if isinstance(requested, int):
            bound.arguments["max_cache_len"] = cache_length(self, requested + (plan.pad if plan is not None else 0))
        cache = original(*bound.args, **bound.kwargs)
        if plan is not None and plan.chunked:
            _initialize_before_compiled_prefill(self, cache, bound.arguments.get("batch_size"))
        return cache

    return sized


def _initialize_before_compiled_prefill(model: Any, cache: Any, batch_size: Any) -> None:
    """Allocate a fresh static cache before the compiled prefill (4.x initialises it lazily, inside the graph).

    A cache allocated inside the first compiled prefill makes that graph differ from the next call's (the
    cache then exists): one prefill graph per bucket would become two. Transformers 5.x does this itself.
    """
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    if not isinstance(batch_size, int) or not layers or all(getattr(x, "is_initialized", True) for x in layers):
        return
    early = getattr(cache, "early_initialization", None)
    shape = _head_shape(model)
    if not callable(early) or shape is None:
        return
    try:
        early(batch_size=batch_size, num_heads=shape[0], head_dim=shape[1], dtype=model.dtype, device=model.device)
    except Exception as exc:  # lazy initialisation still works: one more prefill graph at worst
        logger.debug("accelerate_neuron: could not initialise the static cache ahead of the prefill: %s", exc)


def _head_shape(model: Any) -> tuple[int, int] | None:
    """(KV heads, head dim) of the decoder's attention, as a static cache stores them; None if not one shape."""
    own = getattr(model, "_get_static_cache_init_shape", None)
    if callable(own):  # upstream's own answer where it has one (tensor parallel, MLA, ...)
        shape = own()
        return shape if shape is not None and all(isinstance(v, int) for v in shape) else None
    if split_across_devices(model):  # layers on several cores: each allocates its own, lazily
        return None
    try:
        config = model.config.get_text_config(decoder=True)
    except Exception:
        config = getattr(model, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int):
        head_dim = config.hidden_size // config.num_attention_heads
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return None
    return heads, head_dim


def _mode_name(generation_mode: Any) -> str:
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


def wrap_prepare_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(
        self: Any,
        generation_config: Any,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if model_device(self) is None:
            return original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        caller_cache = _caller_chose_cache(generation_config, model_kwargs)
        if (
            not caller_cache
            and _mode_name(generation_mode) in _STATIC_MODES
            and not getattr(generation_config, "is_assistant", False)
            and _supports_static_cache(self)
            and static_cache_default_enabled()
        ):
            generation_config.cache_implementation = "static"
            _announce()
        plan = padding.current()
        if plan is not None:
            compiles = not getattr(generation_config, "disable_compile", False) and not split_across_devices(self)
            bucketing.plan_call(self, plan, generation_config, model_kwargs, _mode_name(generation_mode), compiles)
        result = original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if plan is not None and plan.dummy and not self._valid_auto_compile_criteria(model_kwargs, generation_config):
            # Dummy rows are cut from the compiled call's logits: without compiling there is no place to cut them.
            bucketing.drop_rows(plan, model_kwargs)
            result = original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if plan is not None:
            bucketing.announce(plan)
        return result

    return prepare


def _announce() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    logger.warning(
        "accelerate_neuron: generate() on Neuron uses a static KV cache (length rounded up to a bucket, see %s) so "
        "the decode step compiles once instead of once per token. Opt out with cache_implementation='dynamic' or "
        "%s=0.",
        BUCKETS_ENV,
        STATIC_CACHE_ENV,
    )


# --- compiled decode ------------------------------------------------------------------------------

_COMPILE_KEYS = ("backend", "dynamic", "fullgraph", "mode", "options")


def default_compile_config() -> Any:
    """``CompileConfig`` from the ``neuron_compile_config(purpose="generate")`` hook."""
    from transformers.generation.configuration_utils import CompileConfig

    settings = call_hook("neuron_compile_config", purpose="generate") or {}
    unknown = sorted(set(settings) - set(_COMPILE_KEYS))
    if unknown:
        raise ValueError(
            f"neuron_compile_config returned unknown key(s) {unknown} for 'generate'; allowed: {list(_COMPILE_KEYS)}"
        )
    values = {k: v for k, v in settings.items() if v is not None or k == "dynamic"}
    # torch.compile forwards any mode but "default" to a non-inductor backend as a kwarg.
    values.setdefault("mode", "default")
    return CompileConfig(**values)


def _compileable_cache(model_kwargs: dict[str, Any]) -> bool:
    """Upstream's own cache criterion for auto-compile: a compileable cache that is not a DynamicCache."""
    cache = next((model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None), None)
    decoder = getattr(cache, "self_attention_cache", cache)
    return bool(getattr(cache, "is_compileable", False)) and type(decoder).__name__ != "DynamicCache"


_warned_split = False


def _skip_compile_for_split_model() -> None:
    global _warned_split
    if _warned_split:
        return
    _warned_split = True
    logger.warning(
        "accelerate_neuron: generate() does not auto-compile a model dispatched across several Neuron cores: "
        "its decode step would be one graph holding tensors of several cores, and a NEFF runs on one NeuronCore "
        "(torch-neuronx's support for such graphs is unverified). Decode runs eagerly with a static cache "
        "instead; pass compile_config=CompileConfig(...) to compile anyway, "
        "or load the model on one core (device_map={'': 0}) if it fits."
    )


def wrap_auto_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """Let ``_valid_auto_compile_criteria`` accept Neuron, with Neuron's compile defaults."""

    @functools.wraps(original)
    def valid(self: Any, model_kwargs: dict[str, Any], generation_config: Any) -> bool:
        if model_device(self) is None or getattr(generation_config, "disable_compile", False):
            return original(self, model_kwargs, generation_config)
        config = getattr(generation_config, "compile_config", None)
        if config is None and not _compileable_cache(model_kwargs):
            # Nothing to compile (e.g. a dynamic cache): adding a config would only make upstream
            # warn that it cannot honour it.
            return original(self, model_kwargs, generation_config)
        if config is None and split_across_devices(self):
            _skip_compile_for_split_model()
            return False
        if config is None:
            config = default_compile_config()
        elif not getattr(config, "_compile_all_devices", None):
            config = copy.copy(config)  # the caller's object stays as they made it
        # Upstream's own escape hatch: 4.x's gate accepts only CUDA without it.
        config._compile_all_devices = True
        generation_config.compile_config = config
        return original(self, model_kwargs, generation_config)

    return valid
