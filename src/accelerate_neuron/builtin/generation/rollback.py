"""A model's forwards over a static KV cache rolled back by position, at a few widths: what speculation runs.

Speculative decoding feeds a model some tokens, keeps the ones the target accepts and throws the rest away.
Upstream does that with a dynamic cache it crops: every forward then has a new KV length and a new query length,
a new set of op shapes each time on Neuron. A :class:`Runner` instead owns one static cache per model and call,
and a position (:attr:`Runner.length`, the tokens the cache holds):

- a forward of n tokens writes them at the position, right-padded to a width (:mod:`.widths`); the pad writes
  slots beyond the real tokens, which every real query is causally masked from, and which the next forward
  overwrites;
- rolling back is moving the position (:meth:`Runner.rollback`): nothing is copied or cut;
- the forward is compiled with the ``neuron_compile_config("generate")`` settings: one graph per (width, cache
  length), whatever the prompt, the candidates or the acceptance.

:class:`PositionCache` is what upstream's draft loop (the assistant's own ``generate()``) holds in place of a
cache: a ``DynamicCache`` whose length is the runner's position and whose ``crop`` moves it, in either release's
meaning of ``crop``. Only full-attention static layers can be rolled back this way (:func:`unsupported_reason`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...plugins import call_hook
from .. import shapes
from ..compile_options import compile_options
from . import cache as gcache
from .widths import Widths

logger = logging.getLogger(__name__)

KEEP_ALL, KEEP_LAST, KEEP_ARGMAX = "all", "last", "argmax"

_compiled: weakref.WeakKeyDictionary[Any, tuple[Any, Callable[..., Any]]] = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


def _static_cache_class() -> type:
    from transformers.cache_utils import StaticCache

    return StaticCache


def unsupported_reason(model: Any) -> str | None:
    """Why ``model``'s cache cannot be a static cache rolled back by position (None: it can)."""
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not support a static cache"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model"
    names = _forward_parameters(type(model))
    if not ({"cache", "past_key_values"} & set(names)):
        return f"{type(model).__name__}.forward takes no KV cache"
    try:
        probe = _static_cache_class()(config=model.config, max_cache_len=8)  # allocates nothing until used
    except Exception as exc:
        return f"no static cache for its config ({exc})"
    from transformers.cache_utils import StaticLayer

    layers = getattr(probe, "layers", None)
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return "its cache has sliding-window or other non-full-attention layers (they cannot be rolled back)"
    return None


@functools.lru_cache(maxsize=64)
def _forward_parameters(cls: type) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return ()


@functools.lru_cache(maxsize=1)
def crop_removes_only() -> bool:
    """Whether the installed release's ``Cache.crop(n)`` only removes tokens (5.x: ``crop(0)`` removes none) or
    also keeps the first ``n`` when ``n >= 0`` (4.x: ``crop(0)`` empties the cache). Asked of its DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    try:
        DynamicLayer().crop(1)
    except Exception:
        return True
    return False


def compile_settings() -> dict[str, Any]:
    return compile_options(call_hook("neuron_compile_config", purpose="generate") or {}, "generate")


def _logits_and_picks(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` returning its logits and their argmax: the pick is part of the graph (an eager argmax would be
    one more op signature per width on Neuron)."""

    def step(**inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = forward(**inputs).logits
        return logits, logits.argmax(dim=-1)

    return step


def compiled_forward(model: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (the model's own, beneath any wrapper of this call), with its argmax, compiled once per model.

    The forward itself is compiled, not ``model.__call__``: an instance attribute this plugin sets for one call
    would otherwise be a guard of the graph, and the next call's would not match it.
    """
    key = getattr(forward, "__func__", forward)
    with _compiled_lock:
        entry = _compiled.get(model)
        if entry is None or entry[0] is not key:
            shapes.make_room_for_buckets("speculative decoding compiles one graph per width and cache length")
            entry = _compiled[model] = (key, torch.compile(_logits_and_picks(forward), **compile_settings()))
    return entry[1]


class Runner:
    """One model's forwards in one speculative call: a static cache, its position, bucketed widths."""

    def __init__(
        self,
        model: Any,
        forward: Callable[..., Any],
        widths: Widths,
        capacity_hint: int,
        compiled: bool = True,
    ) -> None:
        self.model = model
        self.device = model.device
        self.widths = widths
        self.capacity_hint = capacity_hint
        self.length = 0  # tokens the cache holds: the next forward writes at this position
        self.forwards = 0
        self.cache: Any = None
        self.capacity = 0
        self._forward = compiled_forward(model, forward) if compiled else _logits_and_picks(forward)
        names = _forward_parameters(type(model))
        self._cache_kw = "cache" if "cache" in names else "past_key_values"
        self._cache_position = "cache_position" in names  # 4.x writes at cache_position; 5.x at the layer's length
        pad = getattr(model.config, "pad_token_id", None)
        vocab = getattr(model.config, "vocab_size", None)
        self._filler = pad if isinstance(pad, int) and isinstance(vocab, int) and 0 <= pad < vocab else 0

    # ------------------------------------------------------------------ the cache

    def _ensure(self, needed: int) -> None:
        """A cache of at least ``needed`` positions (a larger bucket keeps what the smaller one held)."""
        if self.cache is not None and needed <= self.capacity:
            return
        capacity = gcache.cache_length(self.model, max(needed, self.capacity_hint))
        new = _static_cache_class()(config=self.model.config, max_cache_len=capacity)
        gcache.initialize_before_compiled_prefill(self.model, new, 1)
        if self.cache is not None:
            for old_layer, new_layer in zip(self.cache.layers, new.layers, strict=True):
                for name in ("keys", "values"):
                    getattr(new_layer, name)[..., : self.capacity, :].copy_(getattr(old_layer, name))
            logger.debug(
                "accelerate_neuron: speculative decoding grew %s's static cache from %d to %d positions",
                type(self.model).__name__,
                self.capacity,
                capacity,
            )
        self.cache, self.capacity = new, capacity

    def _seek(self, position: int) -> None:
        """5.x static layers write at their own length (a tensor): put it at ``position``. 4.x writes at the
        ``cache_position`` input instead."""
        target = None
        for layer in self.cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                if target is None:
                    target = torch.tensor(position, dtype=length.dtype)
                length.copy_(target)  # a host-to-device copy, not an op on the device

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens: the next forward writes there (stale slots beyond are masked, then
        overwritten)."""
        self.length = max(0, min(length, self.length))

    def returned_cache(self) -> Any:
        """The cache as ``generate()`` returns it: slots beyond the position zeroed (4.x measures a static cache's
        length by its non-zero slots), the 5.x length at the position. Fixed-shape ops only."""
        if self.cache is None:
            return None
        keep = (torch.arange(self.capacity) < self.length).view(1, 1, -1, 1)
        keep_on = {}
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                mask = keep_on.get(tensor.device)
                if mask is None:
                    mask = keep_on[tensor.device] = keep.to(device=tensor.device, dtype=tensor.dtype)
                tensor.mul_(mask)
        self._seek(self.length)
        return self.cache

    # ------------------------------------------------------------------ one forward

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, keep: str = KEEP_ALL, floor: int = 0) -> Any:
        """Run the ``[1, n]`` host tokens ``ids`` at the position; ``mask``: the caller's 2D attention mask for
        every token so far (``[1, length + n]``, None: all ones).

        Returns, on the host: the float32 logits of the n tokens (``keep="all"``, ``[1, n, vocab]``), of the last
        one (``"last"``, ``[1, 1, vocab]``), or their argmax picked on the device (``"argmax"``, ``[1, n]``).
        """
        ids = ids.to("cpu")
        n = ids.shape[1]
        start = self.length
        width = self.widths.width(n, first=start == 0, floor=floor)
        self._ensure(start + width)
        padded = torch.full((1, width), self._filler, dtype=torch.long)
        padded[:, :n] = ids
        full = torch.ones((1, self.capacity), dtype=torch.long)
        if mask is not None:
            seen = min(mask.shape[-1], self.capacity)
            full[:, :seen] = mask[:, :seen].to("cpu")
        # Positions as upstream derives them from the mask (a left pad never moves a real token); the right pad
        # continues them.
        positions = (full.cumsum(-1) - 1).masked_fill_(full == 0, 1)[:, start : start + width]
        inputs = {
            "input_ids": padded.to(self.device),
            "attention_mask": full.to(self.device),
            "position_ids": positions.to(self.device),
            self._cache_kw: self.cache,
            "use_cache": True,
            "return_dict": True,
        }
        if self._cache_position:
            inputs["cache_position"] = torch.arange(start, start + width).to(self.device)
        else:
            self._seek(start)
        logits, picks = self._forward(**inputs)
        self.length = start + n
        self.forwards += 1
        # Whole padded rows cross to the host and are cut there: a slice of n rows copied from the device would be
        # one more op signature per n.
        if keep == KEEP_ARGMAX:
            return picks.to("cpu")[:, :n]
        logits = logits.to("cpu")
        if keep == KEEP_LAST:
            return logits[:, n - 1 : n].float()
        return logits[:, :n].float()


@functools.lru_cache(maxsize=1)
def _position_cache_class() -> type:
    """:class:`PositionCache`'s class, built on first use (this module must not import transformers on import)."""
    from transformers.cache_utils import DynamicCache

    class PositionCache(DynamicCache):
        """What upstream's draft loop holds as its cache: a length (the runner's position) and a ``crop`` that moves
        it. It never holds a tensor: the runner's static cache does."""

        is_compileable = False  # upstream must not compile around it: the runner compiles its own forward
        is_croppable = True

        def __init__(self, runner: Runner) -> None:
            super().__init__()
            self.runner = runner

        def get_seq_length(self, layer_idx: int | None = 0) -> int:
            return self.runner.length

        def crop(self, max_length: int) -> None:
            length = self.runner.length
            if max_length < 0:
                length += max_length
            elif max_length > 0 or not crop_removes_only():
                length = min(length, max_length)  # 4.x: keep the first max_length tokens
            self.runner.rollback(length)

        def activate_past_recording(self, *args: Any, **kwargs: Any) -> None:
            return None  # nothing to record: rolling back never loses a state

    return PositionCache


def position_cache(runner: Runner) -> Any:
    """A :class:`PositionCache` over ``runner``."""
    return _position_cache_class()(runner)


def is_position_cache(value: Any) -> bool:
    return _position_cache_class.cache_info().currsize > 0 and isinstance(value, _position_cache_class())
