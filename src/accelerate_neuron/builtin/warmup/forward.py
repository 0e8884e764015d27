"""Bucketed inference calls in a warm-up: each distinct shape compiled once across the workers.

An inference call's shape is read where the inference plugin runs it
(:meth:`~..inference.call.ForwardCall.run`): the inputs are padded to their
buckets by then, exactly as in the real run. A new shape in this worker's
shard runs compiled (its graph lands in the NEFF cache); a shape this worker
compiled already runs from memory. A shape another worker compiles gets a
stand-in instead: zeros of the outputs' real structure, shaped from an output
this worker computed for the same model and arguments, so the script (a
pipeline's post-processing, ``encode``'s pooling of the result) carries on
without compiling that graph a second time. Before the first output of a
model exists, or for outputs that cannot be shaped so (a KV cache), the call
runs for real.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import precompile_session as session
from ..model_tag import model_tag
from ..shapes import Unplaced, sequence_dims
from ..shapes.groups import shapes_of

#: Graphs one inference shape compiles at most (Dynamo may break a forward in pieces; priced as one).
GRAPHS_PER_SHAPE = 1

#: model -> (arguments key) -> (an output computed at (rows, length)).
_templates: weakref.WeakKeyDictionary[Any, dict[str, tuple[Any, int, int]]] = weakref.WeakKeyDictionary()


def call_shape(call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What decides the graph of one bucketed forward."""
    return {
        "model": model_tag(call.model),
        "dtype": str(getattr(call.model, "dtype", "")),
        "rows": call.padded_rows,
        "length": call.padded_length,
        "groups": shapes_of(getattr(call, "groups", None)),
        "inputs": sorted(call.inputs),
        "arguments": _arguments(args, kwargs),
        "compiled": call.compiled,
    }


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The call's arguments apart from its tensors (flags such as output_hidden_states, a dict's keys)."""

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return "tensor"
        if isinstance(value, dict):
            return {k: describe(v) for k, v in sorted(value.items())}
        return repr(value)

    return repr([describe(a) for a in args] + [(k, describe(v)) for k, v in sorted(kwargs.items())])


def wrap_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ForwardCall.run`` in a warm-up worker: compile this worker's shapes, stand in for the others'."""

    @functools.wraps(original)
    def run(self: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        warm = session.current()
        if warm is None:
            return original(self, call, *args, **kwargs)
        shape = call_shape(self, args, kwargs)
        key = shape["arguments"]
        templates = _templates.setdefault(self.model, {})
        mine = warm.claim("forward", shape, GRAPHS_PER_SHAPE) or warm.owns("forward", shape)
        if not mine and key in templates:
            try:
                return stand_in(*templates[key], self.rows, self.length)
            except (TypeError, Unplaced):
                pass  # an output structure zeros cannot stand for: computed for real below
        started = time.perf_counter()
        with session.labelled("forward", shape):
            outputs = original(self, call, *args, **kwargs)
        if mine:
            warm.done("forward", shape, time.perf_counter() - started)
        templates.setdefault(key, (outputs, self.rows, self.length))
        return outputs

    return run


def stand_in(template: Any, rows: int, length: int, new_rows: int, new_length: int, name: str = "") -> Any:
    """Zeros shaped like ``template`` (an output for ``rows`` x ``length``) for ``new_rows`` x ``new_length``."""
    if isinstance(template, torch.Tensor):
        shape = list(template.shape)
        if shape and shape[0] == rows:
            shape[0] = new_rows
        # Which dimensions are the sequence: the rules that cut a real call's outputs back (raises Unplaced).
        for dim in sequence_dims(name, template.shape, length) if len(shape) >= 2 else ():
            if shape[dim] == length:
                shape[dim] = new_length
        # Made on the host and copied over: a device-side fill would be one eager op per shape.
        return torch.zeros(shape, dtype=template.dtype).to(template.device)
    if isinstance(template, dict):
        out = template.copy() if type(template) is dict else type(template)(**template)
        for key in list(template.keys()):
            out[key] = stand_in(template[key], rows, length, new_rows, new_length, key)
        return out
    if isinstance(template, (list, tuple)) and not hasattr(template, "_fields"):
        return type(template)(stand_in(v, rows, length, new_rows, new_length, name) for v in template)
    if template is None or isinstance(template, (int, float, str, bool)):
        return template
    raise TypeError(f"cannot stand in for a {type(template).__name__}")
