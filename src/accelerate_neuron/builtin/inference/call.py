"""One inference call of a model on Neuron, bucketed: padded inputs, a compiled forward, the caller's shapes back.

A model called without gradients (``model(**batch)`` under ``torch.no_grad()``,
a ``pipeline``, sentence-transformers' ``encode`` / ``predict``) would see every
new sequence length and batch size as a new shape: a new graph, or new eager op
compiles, on Neuron. A :class:`ForwardCall` instead

1. decides whether the call can be padded invisibly (:meth:`ForwardCall.open`;
   otherwise the reason is logged at debug level and upstream runs as it is);
2. right-pads the sequence inputs (``input_ids``, ``attention_mask`` 0 on the
   pad, ``token_type_ids``, ``position_ids``) to a length bucket and adds dummy
   rows (copies of row 0) up to a batch bucket, on the host, then moves them to
   the model's core: no device op depends on the real length. Images and audio
   (``pixel_values``, ``input_features``, ``input_values``) have the size their
   processor gave them: only their batch is bucketed;
3. runs the forward compiled with the ``neuron_compile_config("forward")``
   settings (one graph per length bucket x batch bucket), or, for a model split
   over several cores (or with ``compile_regions=layers``), with each decoder
   layer compiled on its own core (:mod:`..regions`; eager without regions);
4. cuts every output back to the caller's rows and length (:mod:`..shapes.cut`).

Padding on the right keeps every real token at its position, and the attention
mask keeps the real tokens from attending to the pad, so the results equal the
unpadded call's up to float rounding (a softmax over a longer, masked row).
The buckets are the ``prompt_buckets`` and ``batch_buckets`` settings (the
``neuron_generation_shape_policy`` hook, purpose ``"forward"``), whose built-in
length buckets here are ``pow2-half`` (:mod:`accelerate_neuron.builtin.inference`
says why); ``bucket_forwards`` turns this off for the process, and
:func:`accelerate_neuron.disable_bucketing` for one model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import types
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import logs, settings
from ... import padding as _padding
from ...plugins import call_hook
from .. import layer_regions as regions
from .. import scope, shapes
from ..compile_options import compile_options
from ..model_devices import model_device
from ..shapes import Cut, Unplaced
from ..shapes import groups as shape_groups
from ..shapes.cut import assemble

logger = logging.getLogger(__name__)

#: Sequence-shaped inputs the padded layout knows (their pad values: the shape layer's table).
SEQUENCE_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
#: Inputs whose size per row the processor fixed (images, audio features): only the batch is bucketed. An
#: ``attention_mask`` beside them is per row too (wav2vec2's, over audio samples).
FIXED_SIZE_INPUTS = frozenset({"pixel_values", "input_features", "input_values", "pixel_mask"})
#: Keyword arguments that shape the output, not the input: passed through as given.
_FLAGS = frozenset({"output_attentions", "output_hidden_states", "return_dict", "use_cache", "task"})
#: A model (instance attribute) that must never be bucketed: :func:`disable` sets it.
OPT_OUT_ATTR = "_accelerate_neuron_unbucketed"
#: Set on a model whose outputs could not be cut back once: its calls run unpadded from then on.
UNPLACED_ATTR = "_accelerate_neuron_unplaced"
#: Set on a model whose outputs could not be put together from row groups once: its batches run as one from then on.
UNGROUPED_ATTR = "_accelerate_neuron_ungrouped"


def disable(model: Any, disabled: bool = True) -> Any:
    """Never bucket ``model``'s inference calls (``disabled=False`` undoes it); returns the model."""
    object.__setattr__(model, OPT_OUT_ATTR, disabled)
    return model


def _skip(model: Any, reason: str) -> None:
    logs.once(
        logger,
        ("inference.unbucketed", type(model).__name__, reason),
        "accelerate_neuron: %s inference calls run unpadded: %s",
        type(model).__name__,
        reason,
        level=logging.DEBUG,
    )


@dataclass
class ForwardCall:
    """One bucketed inference call: what was padded, and how to cut the outputs back."""

    model: Any
    device: torch.device
    inputs: dict[str, torch.Tensor]  # the caller's sequence inputs, by name
    rows: int
    length: int
    compiled: bool = True  # False for a model split over several cores (a NEFF runs on one core)
    regional: bool = False  # its decoder layers are compiled one by one instead (the regions plugin)
    tokens: bool = True  # token inputs (lengths bucketed); False: images or audio (only the batch is)
    padded_rows: int = 0
    padded_length: int = 0
    real: int = 0  # positions of the caller's that its attention mask keeps
    groups: list[shape_groups.Group] | None = None  # rows run group by group, each at its own bucket (None: one)
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # the caller's inputs, on the host, unpadded
    fills: dict[str, int] = field(default_factory=dict)  # each input's pad value

    @classmethod
    def open(cls, model: Any, inputs: Mapping[str, torch.Tensor], others: Mapping[str, Any]) -> ForwardCall | None:
        """The call for these inputs, or None when padding would not be invisible (reason at debug level).

        ``inputs``: the call's tensors by name; ``others``: its other arguments.
        """
        if getattr(model, OPT_OUT_ATTR, False) or getattr(model, UNPLACED_ATTR, None):
            return None
        dev = model_device(model)
        if dev is None:
            return None
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            _skip(model, "an encoder-decoder model (generate() buckets its encoder input)")
            return None
        if others.get("past_key_values") is not None or others.get("use_cache") is True:
            _skip(model, "a KV cache passed or asked for (its layout would show the padding)")
            return None
        if finds_last_token_by_pad(type(model)) and getattr(config, "pad_token_id", None) is None:
            _skip(model, "a sequence classifier that finds each row's last token by the pad token, and no pad_token_id")
            return None
        if FIXED_SIZE_INPUTS & inputs.keys():
            rows = _fixed_size_rows(model, inputs)
            if rows is None:
                return None
            length, tokens = 0, False
        else:
            ids = inputs.get("input_ids")
            if ids is None or ids.dim() != 2 or ids.is_floating_point():
                _skip(model, "no 2-D token ids, images or audio features (inputs_embeds ... keep their own shapes)")
                return None
            unknown = sorted(k for k in inputs if k not in SEQUENCE_INPUTS)
            if unknown:
                _skip(model, f"inputs {unknown} (only token ids, masks, token types and positions are padded)")
                return None
            if any(v.shape != ids.shape for v in inputs.values()):
                _skip(model, "inputs of different shapes")
                return None
            rows, length, tokens = int(ids.shape[0]), int(ids.shape[1]), True
        split = len({p.device for p in model.parameters()}) > 1
        regional = regions.enabled(model)
        return cls(
            model,
            dev,
            dict(inputs),
            rows=rows,
            length=length,
            compiled=not split and not regional,
            regional=regional,
            tokens=tokens,
        )

    # ------------------------------------------------------------------ padding

    def pad(self) -> dict[str, torch.Tensor]:
        """The inputs at the bucketed shape, on the model's core (when the rows run in groups: the caller's inputs
        on the host, which :meth:`run` takes each group's share of)."""
        record = shapes.record_key(self.model)
        policy = shapes.resolve_policy(shapes.max_positions(self.model), record, "forward")  # capped at its positions
        if self.tokens:
            self.padded_length = policy.prompt_buckets.pad_to(self.length, "an inference call", "sequence length")
        self.padded_rows = policy.batch_buckets.pad_to(self.rows, "an inference call", "batch size")
        if not self.tokens:  # images and audio keep their size: rows only
            shapes.note(record, "batch_buckets", self.rows)
            self.real = 0
            if self.padded_rows == self.rows:  # nothing to pad: no host trip
                return {name: value.to(self.device) for name, value in self.inputs.items()}
            return {
                name: shapes.add_rows(value.to("cpu"), self.padded_rows).to(self.device)
                for name, value in self.inputs.items()
            }
        config = getattr(self.model, "config", None)
        self.fills = shapes.pad_values(
            shapes.pad_id(config, vocab=getattr(config, "vocab_size", None)), keys=SEQUENCE_INPUTS
        )
        # Padded on the host: no device op sees the real length.
        self.host = {name: value.to("cpu") for name, value in self.inputs.items()}
        mask = self.host.get("attention_mask")
        self.real = int(mask.sum()) if mask is not None else self.rows * self.length
        if mask is None and self.padded_length > self.length:
            self.host["attention_mask"] = torch.ones_like(self.host["input_ids"])
        extents = shape_groups.right_padded_extents(mask) if mask is not None else None
        if extents is not None and not getattr(self.model, UNGROUPED_ATTR, False) and settings.get("group_rows"):
            self.groups = shape_groups.plan(
                extents, self.padded_length, policy.prompt_buckets, policy.batch_buckets, self.padded_rows
            )
        for size in extents or [self.length] * self.rows:  # the sizes the buckets apply to: each row's
            shapes.note(record, "prompt_buckets", size)
        for size in [len(g.rows) for g in self.groups] if self.groups else [self.rows]:
            shapes.note(record, "batch_buckets", size)
        return dict(self.host) if self.groups else self._padded(range(self.rows), self.padded_rows, self.padded_length)

    def _padded(self, rows: Any, padded_rows: int, columns: int) -> dict[str, torch.Tensor]:
        """The inputs of ``rows`` at ``columns`` columns (cut or padded), ``padded_rows`` rows, on the model's core."""
        index = list(rows)
        out = {}
        for name, host in self.host.items():
            value = host[index] if len(index) != host.shape[0] else host
            value = shapes.pad_columns(value[:, :columns], columns, self.fills[name])
            value = shapes.add_rows(value, padded_rows)  # copies of row 0: none all padding
            # A one-row cut keeps the host batch's row stride (a size-1 dim counts as contiguous), and Dynamo guards
            # on strides: without a fresh layout the same group shape compiles again for every batch width.
            out[name] = value.clone(memory_format=torch.contiguous_format).to(self.device)
        return out

    @property
    def computed(self) -> int:
        """Positions this call computes."""
        if self.groups:
            return sum(g.padded_rows * g.bucket for g in self.groups)
        return self.padded_rows * self.padded_length

    @property
    def changes_shapes(self) -> bool:
        return self.padded_rows != self.rows or self.padded_length != self.length

    # ------------------------------------------------------------------ the forward

    def run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` (the model's own ``__call__``, bound) on the padded inputs, compiled unless split; cut back.

        With :attr:`groups`, once per group on its rows at its bucket; the outputs are put back in row order at the
        batch's bucketed shape (:func:`..shapes.cut.assemble`), then cut. Outputs that cannot be put together so
        (a scalar) make this model's calls run as one batch from then on.
        """
        forward = compiled_call(self.model, call) if self.compiled else call
        with scope.owned_by(self), regions.compiled_layers(self.model) if self.regional else contextlib.nullcontext():
            if self.groups:
                try:
                    parts = []
                    for group in self.groups:
                        group_args, group_kwargs = _replaced(args, kwargs, self._group_inputs(group))
                        parts.append(forward(*group_args, **group_kwargs))
                    outputs = assemble(parts, self.groups, self.padded_rows, self.padded_length)
                    return Cut(self.rows, self.length, self.padded_rows, self.padded_length)(outputs)
                except Unplaced as exc:
                    object.__setattr__(self.model, UNGROUPED_ATTR, str(exc))
                    _skip(self.model, f"its outputs cannot be put together from row groups ({exc})")
                    self.groups = None
                    args, kwargs = _replaced(
                        args, kwargs, self._padded(range(self.rows), self.padded_rows, self.padded_length)
                    )
            outputs = forward(*args, **kwargs)
        return Cut(self.rows, self.length, self.padded_rows, self.padded_length)(outputs)

    def _group_inputs(self, group: shape_groups.Group) -> dict[str, torch.Tensor]:
        return self._padded(group.rows, group.padded_rows, group.bucket)

    def announce(self) -> None:
        if not self.tokens:
            logs.once(
                logger,
                "inference.buckets.fixed_size",
                "accelerate_neuron: inference calls on Neuron with images or audio features (model(...) without "
                "gradients, pipelines) pad their batch to a batch bucket and run compiled, so varied batch sizes reuse "
                "a few compiled graphs (this call: %s, batch %d -> %d; results are the unpadded ones). Opt out with "
                "%s=0, or accelerate_neuron.disable_bucketing(model).",
                type(self.model).__name__,
                self.rows,
                self.padded_rows,
                settings.env_name("bucket_forwards"),
            )
            return
        logs.once(
            logger,
            "inference.buckets",
            "accelerate_neuron: inference calls on Neuron (model(...) without gradients, pipelines, "
            "sentence-transformers) pad their inputs to length and batch buckets and run compiled, so varied inputs "
            "reuse a few compiled graphs (this call: %s, length %d -> %d, batch %d -> %d; results are the unpadded "
            "ones). Opt out with %s=0, or accelerate_neuron.disable_bucketing(model).",
            type(self.model).__name__,
            self.length,
            self.padded_length,
            self.rows,
            self.padded_rows,
            settings.env_name("bucket_forwards"),
        )


_compiled: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


def compiled_call(model: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """``model``'s call compiled once with the ``neuron_compile_config("forward")`` settings.

    Kept beside the model, not on it: a model must stay copyable and picklable.
    """
    with _compiled_lock:
        compiled = _compiled.get(model)
        if compiled is None:
            shapes.make_room_for_buckets()
            compiled = _compiled[model] = torch.compile(call, **compile_settings())
    return compiled


def _fixed_size_rows(model: Any, inputs: Mapping[str, torch.Tensor]) -> int | None:
    """The batch size of an image or audio call whose inputs can all be padded with rows, else None (reason logged)."""
    unknown = sorted(k for k in inputs if k not in FIXED_SIZE_INPUTS and k != "attention_mask")
    if unknown:
        _skip(model, f"inputs {unknown} beside images or audio (only their batch is padded)")
        return None
    rows = {int(v.shape[0]) if v.dim() >= 2 else -1 for v in inputs.values()}
    if len(rows) != 1 or -1 in rows:
        _skip(model, "image or audio inputs without one batch dimension in common")
        return None
    return rows.pop()


@functools.lru_cache(maxsize=256)
def finds_last_token_by_pad(cls: type) -> bool:
    """A decoder's sequence classifier: its forward finds each row's last token by looking for the pad token."""
    if not cls.__name__.endswith("ForSequenceClassification"):
        return False
    try:
        return "pad_token_id" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True  # cannot tell: treat it as one (then it is bucketed only with a pad_token_id)


def compile_settings() -> dict[str, Any]:
    """``torch.compile`` keyword arguments from the ``neuron_compile_config(purpose="forward")`` hook."""
    return compile_options(call_hook("neuron_compile_config", purpose="forward") or {}, "forward")


# ------------------------------------------------------------------ the entry points


def eligible(model: Any) -> bool:
    """The cheap test every model call passes first: no gradients, eval mode, not owned by a call, not traced."""
    return (
        not torch.compiler.is_compiling()  # first: a traced call (generate's compiled step) is never padded again
        and not torch.is_grad_enabled()
        and not getattr(model, "training", True)
        and scope.owner() is None
        and settings.get_quietly("bucket_forwards")
    )


def bucketed(
    model: Any, inputs: Mapping[str, torch.Tensor], others: Mapping[str, Any], run: Callable[[ForwardCall, dict], Any]
) -> tuple[bool, Any]:
    """(True, what ``run(call, padded)`` returns) for a call that can be bucketed, else (False, None)."""
    call = ForwardCall.open(model, inputs, others)
    if call is None:
        _count_as_is(model, inputs)
        return False, None
    try:
        padded = call.pad()
        if not call.changes_shapes and not call.compiled and not call.regional:
            _padding.add("forward", call.rows * call.length, call.real)
            return False, None
        outputs = run(call, padded)
    except Unplaced as exc:
        object.__setattr__(model, UNPLACED_ATTR, str(exc))
        _skip(model, f"its outputs cannot be cut back to the caller's shapes ({exc})")
        _padding.add("forward", call.rows * call.length, call.real)
        return False, None
    except torch.OutOfMemoryError as exc:
        # The bucket's shape needs more memory than the caller's: that call runs as upstream would have.
        logs.once(
            logger,
            ("inference.out_of_memory", type(model).__name__, call.padded_rows, call.padded_length),
            "accelerate_neuron: a bucketed inference call of %s (batch %d -> %d, length %d -> %d) ran out of Neuron "
            "memory; it runs unpadded instead. Smaller buckets (%s) leave more room. (%s)",
            type(model).__name__,
            call.rows,
            call.padded_rows,
            call.length,
            call.padded_length,
            settings.env_name("prompt_buckets"),
            str(exc).splitlines()[0],
        )
        _padding.add("forward", call.rows * call.length, call.real)
        return False, None
    _padding.add("forward", call.computed, call.real)
    call.announce()
    return True, outputs


def _replaced(
    args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Mapping[str, torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments with its inputs replaced: keyword arguments (a model's call) or the features dict that is
    its one positional argument (sentence-transformers)."""
    if args and isinstance(args[0], Mapping) and set(inputs) & set(args[0]):
        return ({**args[0], **inputs}, *args[1:]), kwargs
    return args, {**kwargs, **{k: v for k, v in inputs.items() if k in kwargs or k == "attention_mask"}}


def _count_as_is(model: Any, inputs: Mapping[str, Any]) -> None:
    """Count an inference call of a model on Neuron that runs at the caller's own shape."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or model_device(model) is None:
        return
    mask = inputs.get("attention_mask")
    host_mask = isinstance(mask, torch.Tensor) and mask.shape == ids.shape and mask.device.type == "cpu"
    _padding.add("forward", ids.numel(), int(mask.sum()) if host_mask else ids.numel())


@functools.lru_cache(maxsize=256)
def _parameters(cls: type) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def wrap_model_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """``PreTrainedModel.__call__``: a Transformers model called for inference on Neuron runs bucketed."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not eligible(self):
            return original(self, *args, **kwargs)
        names = _parameters(type(self))
        if len(args) > len(names) or ("attention_mask" not in names and not FIXED_SIZE_INPUTS.intersection(names)):
            return original(self, *args, **kwargs)
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        inputs = {k: v for k, v in given.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in given.items() if not isinstance(v, torch.Tensor)}
        if any(v is not None and k not in _FLAGS for k, v in others.items()):
            return original(self, *args, **kwargs)  # an argument this layout does not know
        config = getattr(self, "config", None)
        wants_tuple = others.get("return_dict", getattr(config, "return_dict", True)) is False
        flags = {k: v for k, v in others.items() if k in _FLAGS and v is not None}
        flags["return_dict"] = True  # fields by name, to cut them; the tuple is made at the end if asked for

        def run(call: ForwardCall, padded: dict[str, Any]) -> Any:
            outputs = call.run(types.MethodType(original, self), **padded, **flags)
            return outputs.to_tuple() if wants_tuple and hasattr(outputs, "to_tuple") else outputs

        done, outputs = bucketed(self, inputs, others, run)
        return outputs if done else original(self, *args, **kwargs)

    return __call__


def wrap_sentence_transformer_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """sentence-transformers' ``BaseModel.__call__`` (SentenceTransformer, CrossEncoder, SparseEncoder): the
    whole module chain (transformer, pooling, normalisation, score head) runs bucketed as one compiled call."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not eligible(self) or len(args) != 1 or not isinstance(args[0], MutableMapping):  # dict, BatchEncoding
            return original(self, *args, **kwargs)
        features = args[0]
        tensors = {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in features.items() if not isinstance(v, torch.Tensor)}

        def run(call: ForwardCall, padded: dict[str, Any]) -> Any:
            outputs = call.run(types.MethodType(original, self), {**rest, **padded}, **kwargs)
            # Upstream's modules add their outputs to the caller's dict; so does the bucketed call, keeping the
            # caller's own input tensors.
            features.update({k: v for k, v in outputs.items() if k not in tensors})
            return features

        done, outputs = bucketed(self, tensors, {}, run)
        return outputs if done else original(self, *args, **kwargs)

    return __call__
