"""The adapters between upstream's ``GenerationMixin`` and this plugin: thin, each asks the current call.

Every wrapper here is what a patch in the plugin's table puts in place of an
upstream method. On a model that is not on Neuron each one calls upstream
unchanged; otherwise it hands the decision to the current
:class:`~.call.GenerateCall` (or to :mod:`.cache` for the static cache and the
compile settings) and calls upstream with the answer.

Forward inputs go to the device through the *instance's*
``prepare_inputs_for_generation``, wrapped for the duration of one
``generate`` call: many models override that method without calling
``super()`` (102 in Transformers 4.57), so patching the shared implementation
would miss them, and a forward pre-hook would run inside the compiled call and
put host-to-device copies into the graph.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import overrides, shapes
from . import cache, devices, draft, encoder_decoder, padding, sampling, speculation
from .call import GenerateCall, current
from .concurrency import one_call_at_a_time

# Model kwargs the encoder never reads (upstream's own `irrelevant_prefix`).
_NOT_FOR_ENCODER = ("decoder_", "cross_attn", "use_cache", "cache", "past_key_values")
_INSTANCE_ATTR = "prepare_inputs_for_generation"
_MOVER_FLAG = "_accelerate_neuron_mover"
logger = logging.getLogger(__name__)

# Transformers < 5.20 warns whenever input_ids and the model differ in device
# type; host-side input_ids are this plugin's intent, not a user mistake.
_CPU_INPUT_WARNING = (
    r"You are calling \.generate\(\) with the `input_ids` being on a device type different.*"
    r"`input_ids` is on cpu, whereas the model is on neuron"
)


def wrap_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        dev = devices.model_device(self)
        if dev is None:
            return original(self, *args, **kwargs)
        call, args, kwargs = GenerateCall.open(self, dev, args, kwargs)
        with one_call_at_a_time(self), call.running(), forward_inputs_on(self, dev), quiet_host_input_warning():
            result = original(self, *args, **kwargs)
        return call.close(result)

    return generate


@contextlib.contextmanager
def forward_inputs_on(model: Any, dev: Any) -> Iterator[None]:
    """For one ``generate`` call: the current call's layout for every forward's inputs, moved to ``dev``.

    Wraps whatever ``model.prepare_inputs_for_generation`` resolves to (the
    model's own override included) on the instance, and removes the wrapper
    afterwards. Nested or concurrent ``generate`` calls on one model share it;
    each forward asks the call of its own context.
    """

    def build(inner: Any) -> Any:
        # Upstream reads this method's signature (accepted kwargs, inputs_embeds support): keep the inner one.
        @functools.wraps(inner)
        def mover(*args: Any, **kwargs: Any) -> Any:
            call = current(model)
            if call is not None:
                args, kwargs = call.forward_inputs(args, kwargs)
            prepared = inner(*args, **kwargs)
            if draft.is_drafting(model):  # a speculative draft's forward runs on its runner, from host tensors
                return prepared
            if call is not None and call.prefill_on_host:
                return prepared  # the prefill's groups take their rows on the host (see .groups)
            return devices.move(prepared, dev)

        return mover

    with overrides.overridden(model, _INSTANCE_ATTR, _MOVER_FLAG, build):
        yield


@contextlib.contextmanager
def quiet_host_input_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CPU_INPUT_WARNING, category=UserWarning)
        yield


def wrap_prepare_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_prepare_cache_for_generation``: the static cache default, then the call's plan, before the cache exists."""

    @functools.wraps(original)
    def prepare(
        self: Any, generation_config: Any, model_kwargs: dict[str, Any], generation_mode: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if devices.model_device(self) is None:
            return original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        mode = cache.mode_name(generation_mode)
        cache.choose_static_cache(self, generation_config, model_kwargs, mode)
        call = current(self)
        if call is not None:
            call.plan(generation_config, model_kwargs, mode)
        result = original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if call is not None and not call.rows_confirmed(model_kwargs, generation_config):
            # Dummy rows are cut from the compiled call's logits: without compiling there is no place to cut
            # them, so the cache is built again for the caller's own rows (a case the plan did not foresee).
            result = original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if call is not None:
            call.announce()
        return result

    return prepare


def wrap_static_cache_length(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_get_cache`` (4.x) / ``_prepare_static_cache`` (5.x): the cache's batch bucket and bucketed length."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sized(self: Any, *args: Any, **kwargs: Any) -> Any:
        if devices.model_device(self) is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        batch, requested = bound.arguments.get("batch_size"), bound.arguments.get("max_cache_len")
        call = current(self)
        if call is not None:
            batch, requested = call.cache_shape(batch, requested)
            if "batch_size" in bound.arguments:
                bound.arguments["batch_size"] = batch
        if isinstance(requested, int):
            bound.arguments["max_cache_len"] = cache.cache_length(self, requested)
        built = original(*bound.args, **bound.kwargs)
        # An encoder-decoder's first step is compiled too (:mod:`.encoder_decoder`); its cache needs allocating first
        # only where upstream keeps one cache between calls (4.x ``model._cache``): a fresh one per call is
        # initialised in the same graph every call.
        kept = call is not None and call.has_encoder and getattr(self, "_cache", None) is built
        if call is not None and (call.chunked or kept):
            cache.initialize_before_compiled_prefill(self, built, bound.arguments.get("batch_size"))
        return built

    return sized


def wrap_auto_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_valid_auto_compile_criteria``: Neuron accepted, with Neuron's compile defaults."""

    @functools.wraps(original)
    def valid(self: Any, model_kwargs: dict[str, Any], generation_config: Any) -> bool:
        if devices.model_device(self) is None:
            return original(self, model_kwargs, generation_config)
        call = current(self)
        regional = call is not None and call.regional
        config = cache.compile_config_for(self, model_kwargs, generation_config, regional=regional)
        if config is False:
            return False
        if config is not None:
            generation_config.compile_config = config
        return original(self, model_kwargs, generation_config)

    return valid


def _bound(
    signature: inspect.Signature, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[GenerateCall, inspect.BoundArguments] | None:
    """The current call and a decoding loop's arguments by name; None (upstream's loop as called) outside a call
    on Neuron, or when they do not bind to the loop's signature (a newer release's)."""
    call = current(model)
    if call is None:
        return None
    try:
        return call, signature.bind(model, *args, **kwargs)
    except TypeError:
        return None


def wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_sample``: the next token picked on the device (greedy: the argmax; sampling: the whole draw, see
    :mod:`.sampling`) when nothing on the host needs the logits."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = _bound(signature, self, args, kwargs)
        if found is None:
            return original(self, *args, **kwargs)
        call, bound = found
        arguments = bound.arguments
        chosen = sampling.plan(
            call, arguments.get("input_ids"), arguments.get("logits_processor"), arguments.get("generation_config")
        )
        if chosen is not None:
            # Upstream's loop runs without processors and takes the argmax of the one-hot rows of the tokens
            # drawn on the device; its own copy of the config says so (the caller's stays as it was).
            from transformers.generation.logits_process import LogitsProcessorList

            arguments["logits_processor"] = LogitsProcessorList()
            arguments["generation_config"] = chosen.host_config
            call.sampling = chosen
            try:
                with sampling.choosing_on(self, current):
                    return original(*bound.args, **bound.kwargs)
            finally:
                call.sampling = None
        call.choose_greedy(
            arguments.get("input_ids"), arguments.get("logits_processor"), arguments.get("generation_config")
        )
        try:
            return original(self, *args, **kwargs)
        finally:
            call.greedy = False

    return _sample


def wrap_assisted_decoding(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_assisted_decoding``: speculative decoding at bounded shapes (:mod:`.speculation`), or upstream's loop."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _assisted_decoding(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = _bound(signature, self, args, kwargs)
        if found is None:
            return original(self, *args, **kwargs)
        call, bound = found
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        try:
            return speculation.decode(self, arguments)
        except speculation.Declined as reason:
            logger.debug("accelerate_neuron: assisted generate() runs in upstream's loop: %s", reason)
        # Upstream moves the candidates to the model's device and compares them with the sequence: the sequence
        # goes there too (generate() brought it to the host), and the result comes back to the host.
        arguments.pop("self")
        model_kwargs = arguments.pop("model_kwargs", {}) or {}
        dev = call.device
        moved = {k: devices.move(v, dev) if k in ("input_ids", "inputs_tensor") else v for k, v in arguments.items()}
        model_kwargs = {k: v if k in devices.KEEP_IN_PLACE else devices.move(v, dev) for k, v in model_kwargs.items()}
        return devices.send_back(original(self, **moved, **model_kwargs), torch.device("cpu"))

    return _assisted_decoding


def wrap_get_compiled_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_compiled_call``: the compiled forward, then the call's dummy-row cut or greedy pick."""

    @functools.wraps(original)
    def get_compiled_call(self: Any, compile_config: Any) -> Callable[..., Any]:
        call = current(self)
        if call is None:
            return original(self, compile_config)
        if call.regional:  # the model's call itself runs, its layers compiled (a whole-model graph is never built)
            return call.compiled(call.regional_call())
        compiled = original(self, compile_config)
        if _bound_call_of(self, compiled):
            compiled = cache.compile_refused_family(self, compile_config)
        return call.compiled(compiled)

    return get_compiled_call


def _bound_call_of(model: Any, fn: Any) -> bool:
    """Whether ``fn`` is ``model.__call__`` itself: upstream declined to compile (Llama 4, every release)."""
    return getattr(fn, "__self__", None) is model and getattr(fn, "__func__", None) is type(model).__call__


def wrap_encoder_kwargs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Run the encoder on the model's device, its input length bucketed and its call compiled, while the decoder's
    bookkeeping stays on the host."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare(self: Any, inputs_tensor: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        dev = devices.model_device(self)
        if dev is None:
            return original(self, inputs_tensor, model_kwargs, *args, **kwargs)
        try:
            generation_config = signature.bind(self, inputs_tensor, model_kwargs, *args, **kwargs).arguments.get(
                "generation_config"
            )
        except TypeError:
            generation_config = None
        pad = padding.encoder_pad(self, inputs_tensor, generation_config)
        padding.count_encoder_positions(inputs_tensor, model_kwargs.get("attention_mask"), pad)
        if pad:
            # The encoder runs once per call: bucketing its length keeps its eager ops and the decoder's
            # cross-attention graphs to one shape per bucket. model_kwargs keeps the padded mask for the decoder.
            filler = shapes.pad_id(self.config, vocab=getattr(self.config, "vocab_size", None))
            inputs_tensor = padding.pad_encoder_inputs(inputs_tensor, model_kwargs, pad, filler)
        for_encoder = {
            k: v if k.startswith(_NOT_FOR_ENCODER) else devices.move(v, dev) for k, v in model_kwargs.items()
        }
        call = current(self)
        compiled = call is not None and not call.regional and call.compiles(generation_config)
        with encoder_decoder.encoder_compiled(self, generation_config) if compiled else contextlib.nullcontext():
            result = original(self, devices.move(inputs_tensor, dev), for_encoder, *args, **kwargs)
        # Keep the caller's (host) values for what the encoder only read; add what it produced.
        for key, value in result.items():
            if key in model_kwargs and value is for_encoder.get(key):
                continue
            model_kwargs[key] = value
        return model_kwargs

    return prepare
