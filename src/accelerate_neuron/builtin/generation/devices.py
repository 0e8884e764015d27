"""Where ``generate()``'s tensors live when the model is on Neuron.

The rule: the tensors the loop grows every step (ids, attention mask,
position ids, ...) stay on the host, so every compiled decode graph sees the
same input shapes; only what ``forward`` consumes moves to the model's device,
right before each forward; the result goes back to the device the caller's
inputs were on. Where each growing tensor lives is the
``neuron_generation_tensor_device`` hook's answer.

Forward inputs are moved by wrapping the *instance's*
``prepare_inputs_for_generation`` for the duration of one ``generate`` call:
many models override that method without calling ``super()`` (102 in
Transformers 4.57), so patching the shared implementation would miss them,
and a forward pre-hook would run inside the compiled call and put host-to-device
copies into the graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import device as neuron_device
from ...plugins import call_hook
from . import bucketing, padding
from .concurrency import one_call_at_a_time

#: Keyword arguments of ``generate`` that the loop grows, or that decide the
#: device of what it grows (``inputs_tensor.device`` in upstream's code).
GROWING = (
    "inputs",
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "cache_position",
    "mm_token_type_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
    "decoder_inputs_embeds",
)
#: Names whose device is "the caller's device" for the returned result.
PRIMARY = ("inputs", "input_ids", "inputs_embeds", "decoder_input_ids")
#: Output fields left where the model keeps them.
KEEP_IN_PLACE = frozenset({"past_key_values", "cache", "cache_params"})
# Model kwargs the encoder never reads (upstream's own `irrelevant_prefix`).
_NOT_FOR_ENCODER = ("decoder_", "cross_attn", "use_cache", "cache", "past_key_values")

logger = logging.getLogger("accelerate_neuron")

_INSTANCE_ATTR = "prepare_inputs_for_generation"
_MOVER_FLAG = "_accelerate_neuron_mover"
_lock = threading.Lock()

# Transformers < 5.20 warns whenever input_ids and the model differ in device
# type; host-side input_ids are this plugin's intent, not a user mistake.
_CPU_INPUT_WARNING = (
    r"You are calling \.generate\(\) with the `input_ids` being on a device type different.*"
    r"`input_ids` is on cpu, whereas the model is on neuron"
)


def model_device(model: Any) -> torch.device | None:
    """The model's Neuron device, or ``None`` if it is not on Neuron."""
    try:
        dev = model.device
    except Exception:  # no parameters, or not a PreTrainedModel
        return None
    if isinstance(dev, torch.device) and dev.type == neuron_device.DEVICE_TYPE:
        return dev
    return None


def split_across_devices(model: Any) -> bool:
    """Whether ``model`` was dispatched over several devices (Accelerate's ``hf_device_map``)."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict):
        return False
    return len({str(d) for d in device_map.values() if str(d) not in ("cpu", "disk")}) > 1


def move(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor (also nested in dicts, lists, tuples) on ``device``.

    Containers are rebuilt only if something moved, so ``ModelOutput`` and
    ``Cache`` objects keep their identity (caches are never moved: they live
    on the model's device by construction).
    """
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        moved = {k: move(v, device) for k, v in value.items()}
        if all(moved[k] is value[k] for k in moved):
            return value
        if type(value) is dict:
            return moved
        out = copy.copy(value)
        for k, v in moved.items():
            out[k] = v
        return out
    if isinstance(value, list | tuple):
        items = [move(v, device) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    return value


def _target(name: str, dev: torch.device) -> torch.device | None:
    answer = call_hook("neuron_generation_tensor_device", name=name, model_device=dev)
    if answer is None:
        return None
    try:
        return torch.device(answer)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(
            f"neuron_generation_tensor_device returned {answer!r} for {name!r}: expected a torch.device, "
            "a device string such as 'cpu' or 'neuron:0', or None"
        ) from exc


def bring_home(
    model: Any, dev: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], torch.device | None]:
    """Move the growing tensors the caller put on Neuron to where the hook says.

    Returns the new ``(args, kwargs)`` and the caller's device if the result
    must be sent back there (``None``: leave the result where upstream puts it).
    """
    main_input = getattr(model, "main_input_name", "input_ids")
    names = dict.fromkeys((*GROWING, main_input))
    kwargs = dict(kwargs)
    args = list(args)
    caller: torch.device | None = None
    for name in names:
        if name == "inputs" and args:
            value, where = args[0], "args"
        elif name in kwargs:
            value, where = kwargs[name], "kwargs"
        else:
            continue
        if not isinstance(value, torch.Tensor) or value.device.type != neuron_device.DEVICE_TYPE:
            continue
        hook_name = main_input if name == "inputs" else name
        target = _target(hook_name, dev)
        if target is None or target == value.device:
            continue
        if caller is None and (name in PRIMARY or name == main_input):
            caller = value.device
        moved = value.to(target)
        if where == "args":
            args[0] = moved
        else:
            kwargs[name] = moved
    return tuple(args), kwargs, caller


def send_back(result: Any, caller: torch.device | None) -> Any:
    """The generate result on the caller's device; caches stay on the model's device."""
    if caller is None:
        return result
    if isinstance(result, torch.Tensor):
        return move(result, caller)
    if isinstance(result, dict):  # GenerateOutput classes are ModelOutput (an OrderedDict)
        for key in list(result.keys()):
            if key in KEEP_IN_PLACE:
                continue
            value = result[key]
            moved = move(value, caller)
            if moved is not value:
                result[key] = moved  # ModelOutput.__setitem__ keeps the attribute in step
    return result


@contextlib.contextmanager
def forward_inputs_on(model: Any, dev: torch.device) -> Iterator[None]:
    """For one ``generate`` call: move forward inputs to ``dev`` right after they are prepared.

    Wraps whatever ``model.prepare_inputs_for_generation`` resolves to (the
    model's own override included) on the instance, and removes the wrapper
    afterwards. Nested or concurrent ``generate`` calls on one model share it.
    """
    with _lock:
        current = model.__dict__.get(_INSTANCE_ATTR)
        if getattr(current, _MOVER_FLAG, False):
            mover = current
            mover.users += 1
        else:
            inner = getattr(model, _INSTANCE_ATTR)

            # Upstream reads this method's signature (accepted kwargs, inputs_embeds support): keep the inner one.
            @functools.wraps(inner)
            def mover(*args: Any, **kwargs: Any) -> Any:
                plan = padding.current()
                if plan is not None and (plan.active or plan.chunked):
                    args, kwargs = padding.pad_forward_inputs(plan, args, kwargs)
                return move(inner(*args, **kwargs), dev)

            setattr(mover, _MOVER_FLAG, True)
            mover.users = 1
            mover.previous = current
            object.__setattr__(model, _INSTANCE_ATTR, mover)
    try:
        yield
    finally:
        with _lock:
            mover.users -= 1
            if mover.users == 0 and model.__dict__.get(_INSTANCE_ATTR) is mover:
                if mover.previous is None:
                    del model.__dict__[_INSTANCE_ATTR]
                else:
                    object.__setattr__(model, _INSTANCE_ATTR, mover.previous)


@contextlib.contextmanager
def quiet_host_input_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CPU_INPUT_WARNING, category=UserWarning)
        yield


_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _assisted(model: Any, kwargs: dict[str, Any]) -> bool:
    """Assisted decoding moves candidate ids to ``model.device`` and compares them with ids on the
    sequence's device (upstream, every release), so its sequence must live on the model's device."""
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return any(kwargs.get(k) is not None for k in _ASSISTED) or any(
        getattr(c, k, None) is not None for c in configs for k in _ASSISTED[1:]
    )


def _prompt_length(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Length of a decoder-only call's token prompt (None: nothing the prompt buckets apply to)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    value = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.is_floating_point():
        return None
    if kwargs.get("inputs_embeds") is not None:
        return None
    return int(value.shape[1])


_RETURNED_CACHE = ("past_key_values", "cache")


def _caller_layout(result: Any) -> Any:
    """The returned cache in the caller's layout when this call was padded."""
    plan = padding.current()
    if plan is None or not plan.active or not isinstance(result, dict):
        return result
    for key in _RETURNED_CACHE:  # 5.x: "cache" (and "past_key_values" an alias of it, not a key); 4.x: the latter
        if key in result.keys() and result[key] is not None:
            result[key] = padding.unpadded_cache(result[key], plan)
    return result


def wrap_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        dev = model_device(self)
        if dev is None:
            return original(self, *args, **kwargs)
        caller = None
        prompt = None
        if not _assisted(self, kwargs):
            args, kwargs, caller = bring_home(self, dev, args, kwargs)
            prompt = _prompt_length(self, args, kwargs)
        with (
            one_call_at_a_time(self),
            padding.planning(prompt),
            forward_inputs_on(self, dev),
            quiet_host_input_warning(),
        ):
            result = _caller_layout(original(self, *args, **kwargs))
        return send_back(result, caller)

    return _named_like(generate, original)


def wrap_encoder_kwargs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Run the encoder on the model's device while the decoder's bookkeeping stays on the host."""

    signature = inspect.signature(original)

    def prepare(self: Any, inputs_tensor: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        dev = model_device(self)
        if dev is None:
            return original(self, inputs_tensor, model_kwargs, *args, **kwargs)
        try:
            generation_config = signature.bind(self, inputs_tensor, model_kwargs, *args, **kwargs).arguments.get(
                "generation_config"
            )
        except TypeError:
            generation_config = None
        pad = bucketing.encoder_pad(inputs_tensor, generation_config)
        if pad:
            # The encoder runs once per call: bucketing its length keeps its eager ops and the decoder's
            # cross-attention graphs to one shape per bucket. model_kwargs keeps the padded mask for the decoder.
            filler = getattr(self.config, "pad_token_id", None)
            inputs_tensor = bucketing.pad_encoder_inputs(
                inputs_tensor, model_kwargs, pad, filler if isinstance(filler, int) and filler >= 0 else 0
            )
        for_encoder = {k: v if k.startswith(_NOT_FOR_ENCODER) else move(v, dev) for k, v in model_kwargs.items()}
        result = original(self, move(inputs_tensor, dev), for_encoder, *args, **kwargs)
        # Keep the caller's (host) values for what the encoder only read; add what it produced.
        for key, value in result.items():
            if key in model_kwargs and value is for_encoder.get(key):
                continue
            model_kwargs[key] = value
        return model_kwargs

    return _named_like(prepare, original)


# --- greedy token selection on the device --------------------------------------------------------

_greedy_model: contextvars.ContextVar[Any] = contextvars.ContextVar("accelerate_neuron_greedy_model", default=None)


def _greedy_on_device(dev: torch.device, input_ids: Any, logits_processor: Any, config: Any) -> bool:
    """Whether ``_sample`` may take the argmax on the device and bring back one id per row.

    Only when nothing on the host needs the logits row: greedy, no logits
    processor, no scores/logits returned, and ids kept off the device.
    """
    if config is None or getattr(config, "do_sample", True):
        return False
    if getattr(config, "output_scores", False) or getattr(config, "output_logits", False):
        return False
    if getattr(config, "is_assistant", False):
        return False
    if logits_processor is None or len(logits_processor) != 0:
        return False
    if not isinstance(input_ids, torch.Tensor) or input_ids.device.type == neuron_device.DEVICE_TYPE:
        return False
    target = _target("logits", dev)
    return target is not None and target.type == neuron_device.DEVICE_TYPE


def wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        dev = model_device(self)
        if dev is None:
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind_partial(self, *args, **kwargs).arguments
        except TypeError:
            return original(self, *args, **kwargs)
        if not _greedy_on_device(
            dev, bound.get("input_ids"), bound.get("logits_processor"), bound.get("generation_config")
        ):
            return original(self, *args, **kwargs)
        token = _greedy_model.set(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _greedy_model.reset(token)

    return _named_like(_sample, original)


def select_greedy(outputs: Any, rows: int | None = None) -> Any:
    """Replace ``outputs.logits`` by a host one-hot row of the device-side argmax.

    Upstream copies the last logits row ``[batch, vocab]`` to the host every
    step to take its argmax; the argmax of this one-hot row is the same token,
    and only ``batch`` ids cross the device boundary. ``rows``: keep only the
    first rows (the caller's, when dummy rows pad the batch); the argmax runs on
    the whole padded batch, so its shape is the bucket's.
    """
    logits = getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        return outputs
    ids = logits[:, -1].argmax(dim=-1).to("cpu")
    if rows is not None:
        ids = ids[:rows]
    onehot = torch.zeros((ids.shape[0], 1, logits.shape[-1]), dtype=torch.float32)
    onehot.scatter_(-1, ids.view(-1, 1, 1), 1.0)
    outputs.logits = onehot
    return outputs


#: Graphs one compiled generate() frame may hold: prefill and decode graphs of every bucket a job touches.
#: Dynamo's default (8) would silently fall back to eager after the eighth.
GRAPH_ROOM = 256


def _make_room_for_buckets() -> None:
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < GRAPH_ROOM:
        logger.info(
            "accelerate_neuron: torch._dynamo.config.recompile_limit raised from %d to %d: generate() compiles one "
            "graph per prompt/batch/cache bucket in one frame",
            dynamo_config.recompile_limit,
            GRAPH_ROOM,
        )
        dynamo_config.recompile_limit = GRAPH_ROOM


def wrap_get_compiled_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_compiled_call(self: Any, compile_config: Any) -> Callable[..., Any]:
        call = original(self, compile_config)
        greedy = _greedy_model.get() is self
        plan = padding.current()
        if plan is not None and plan.active:
            _make_room_for_buckets()
        if not greedy and (plan is None or not plan.dummy):
            return call
        rows = plan.batch if plan is not None and plan.dummy else None

        def compiled_then_select(*args: Any, **kwargs: Any) -> Any:
            outputs = call(*args, **kwargs)
            return select_greedy(outputs, rows) if greedy else padding.cut_dummy_rows(plan, outputs)

        return compiled_then_select

    return _named_like(get_compiled_call, original)


def _named_like(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    return functools.wraps(original)(wrapper)
