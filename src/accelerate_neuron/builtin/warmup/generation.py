"""``generate()`` in a warm-up: one compiled prefill and one decode step per distinct shape, then a stand-in result.

The shape of a call is read where upstream's decode loop starts (``_sample`` /
``_beam_search``): by then the generation plugin has bucketed the prompt and the
batch and built the static KV cache exactly as the real call does, so the warm-up
never redoes the bucket arithmetic. A new shape (prompt columns, rows, cache
rows x length, encoder length, loop, compile on/off, greedy pick on device)
in this worker's shard runs the real loop with its stopping criteria replaced by
"stop after one decode step" (end-of-sequence and stop strings cannot end it
earlier, ``max_length`` still can): the prefill graph and the decode graph are
compiled at the real call's shapes. Any other call leaves the loop at once.
Either way the caller gets ``sequences`` of the length the real call could
return (the prompt, then pad tokens), so the script carries on.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import precompile_session as session
from .. import scope, shapes
from ..model_devices import model_device
from ..model_tag import model_tag

#: Graphs one generate shape compiles at most: its prefill and its decode step.
GRAPHS_PER_SHAPE = 2


@dataclass
class WarmCall:
    """What one warm-up ``generate()`` call needs to hand back a result of the right shape."""

    input_ids: torch.Tensor | None
    max_length: int | None = None
    return_sequences: int = 1
    pad_id: int = 0
    as_dict: bool = False
    encoder_decoder: bool = False


_call: contextvars.ContextVar[WarmCall | None] = contextvars.ContextVar("accelerate_neuron_warm_call", default=None)


def _input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return value if isinstance(value, torch.Tensor) else None


def wrap_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        warm = session.current()
        if warm is None or model_device(self) is None or _call.get() is not None:
            return original(self, *args, **kwargs)
        call = WarmCall(_input_ids(args, kwargs))
        call.encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False))
        token = _call.set(call)
        try:
            result = original(self, *args, **kwargs)
        except session.Skip:
            result = None
        finally:
            _call.reset(token)
        return stand_in(result, call)

    return generate


def _cache_shape(model_kwargs: dict[str, Any]) -> list[int | None] | None:
    """(rows, positions) of the KV cache the loop will use; None without one (a dynamic cache grows)."""
    cache = next((model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None), None)
    if cache is None:
        return None
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, list) and layers:
        keys = getattr(layers[0], "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.numel():
            return [int(keys.shape[0]), int(keys.shape[2])]
        return [getattr(layers[0], "max_batch_size", None), getattr(layers[0], "max_cache_len", None)]
    length = getattr(inner, "max_cache_len", None)
    return [getattr(inner, "max_batch_size", None), length] if length else [None, type(cache).__name__]


def _encoder_length(model_kwargs: dict[str, Any]) -> int | None:
    hidden = getattr(model_kwargs.get("encoder_outputs"), "last_hidden_state", None)
    return int(hidden.shape[1]) if isinstance(hidden, torch.Tensor) else None


def call_shape(model: Any, loop: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """What decides the graphs (and the device-side eager ops) of one decode loop."""
    ids = arguments["input_ids"]
    config = arguments["generation_config"]
    model_kwargs = arguments.get("model_kwargs") or {}
    owner = scope.owner()  # the generate() call running this loop: its pad columns, dummy rows, prefill groups
    columns, rows = int(ids.shape[1]), int(ids.shape[0])
    groups = None
    if getattr(owner, "model", None) is model:
        groups = owner.prefill_shapes(model_kwargs, rows) if hasattr(owner, "prefill_shapes") else None
        columns += getattr(owner, "pad", 0)
        rows += getattr(owner, "dummy", 0)
    processors = arguments.get("logits_processor")
    greedy = not getattr(config, "do_sample", False) and not any(
        getattr(config, k, False) for k in ("output_scores", "output_logits")
    )
    return {
        "model": model_tag(model),
        "dtype": str(getattr(model, "dtype", "")),
        "loop": loop,
        "prompt": columns,
        "rows": rows,
        "prefill_groups": groups,
        "cache": _cache_shape(model_kwargs),
        "encoder": _encoder_length(model_kwargs),
        "compiled": not getattr(config, "disable_compile", False),
        "greedy_on_device": greedy and processors is not None and len(processors) == 0,
    }


class _OneDecodeStep:
    """Stops every row once one token past the first (prefill) token is generated."""

    def __init__(self) -> None:
        self.first: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.first is None:
            self.first = input_ids.shape[1]
        done = input_ids.shape[1] > self.first
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _one_decode_step(criteria: Any) -> Any:
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    class OneDecodeStep(_OneDecodeStep, StoppingCriteria):
        pass

    kept = [c for c in (criteria or []) if isinstance(c, MaxLengthCriteria)]
    return StoppingCriteriaList([*kept, OneDecodeStep()])


def filler_id(config: Any) -> int:
    """The token a stand-in result's generated tail is filled with: upstream's own choice (the pad token, else the
    end of sequence, else the decoder's start), through the shape layer's one pad-id choice."""
    return shapes.pad_id(config, names=("pad_token_id", "eos_token_id", "decoder_start_token_id"))


def wrap_decode_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """For ``_sample`` and ``_beam_search``: warm the call's shape once, or leave."""
    signature = inspect.signature(original)
    loop = original.__name__

    @functools.wraps(original)
    def decode_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        call, warm = _call.get(), session.current()
        if call is None or warm is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        config = arguments["generation_config"]
        call.max_length = getattr(config, "max_length", None)
        call.return_sequences = int(getattr(config, "num_return_sequences", 1) or 1)
        call.as_dict = bool(getattr(config, "return_dict_in_generate", False))
        call.pad_id = filler_id(config)
        shape = call_shape(self, loop, arguments)
        if not warm.claim("generate", shape, GRAPHS_PER_SHAPE):
            raise session.Skip
        arguments["stopping_criteria"] = _one_decode_step(arguments.get("stopping_criteria"))
        started = time.perf_counter()
        with session.labelled("generate", shape):
            result = original(*bound.args, **bound.kwargs)
        warm.done("generate", shape, time.perf_counter() - started)
        return result

    return decode_loop


def stand_in(result: Any, call: WarmCall) -> Any:
    """The result a script can go on with: its ``sequences`` at the real call's length (prompt, then pads)."""
    sequences = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    if sequences is None:
        if result is not None:
            return result  # a mode the warm-up ran for real (assisted decoding, ...)
        sequences = _prompt_rows(call)
    target = call.max_length or sequences.shape[1]
    if sequences.shape[1] < target:
        filler = sequences.new_full((sequences.shape[0], target - sequences.shape[1]), call.pad_id)
        sequences = torch.cat([sequences, filler], dim=1)
    if isinstance(result, torch.Tensor) or (result is None and not call.as_dict):
        return sequences
    if result is None:
        from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

        return (GenerateEncoderDecoderOutput if call.encoder_decoder else GenerateDecoderOnlyOutput)(
            sequences=sequences
        )
    result["sequences"] = sequences
    return result


def _prompt_rows(call: WarmCall) -> torch.Tensor:
    ids = call.input_ids
    if ids is None or ids.dim() != 2 or call.encoder_decoder or ids.is_floating_point():
        rows = (ids.shape[0] if ids is not None and ids.dim() >= 1 else 1) * call.return_sequences
        device = ids.device if ids is not None else "cpu"
        return torch.full((rows, 1), call.pad_id, dtype=torch.long, device=device)
    return ids.repeat_interleave(call.return_sequences, dim=0) if call.return_sequences > 1 else ids
