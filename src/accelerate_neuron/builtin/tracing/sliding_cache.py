"""Static sliding-window cache layers that fit their window, traced without a Python position counter.

Sliding-window families (Mistral, Gemma 2 and 3, gpt-oss, ...) keep a
``StaticSlidingWindowLayer`` per sliding layer in a static cache. It counts the
tokens it holds in a Python int (``cumulative_length_int`` in Transformers 5,
``cumulative_length`` in 4.57) and branches on it in ``update`` and
``get_mask_sizes``. Dynamo specialises a Python int: every decode step guards on
a new value and compiles the step again (one more graph per generated token, until
Dynamo's recompile limit sends the rest of the call to eager mode), where Llama or
Qwen compile one decode graph.

When the cache was sized within the window (``max_cache_len <= sliding_window``:
generate()'s static cache of prompt + new tokens, bucketed, under a 4096-token
window), the layer never slides: it behaves exactly like a full static layer.
While Dynamo traces on Neuron, such a layer is updated and sized as a
``StaticLayer`` is: positions from a tensor (the layer's ``cumulative_length``
tensor in 5.x, ``cache_position`` in 4.57), the whole buffer as keys with offset
0, and the sequence length as a tensor. The Python counter is brought up to date
from the tensors at the next eager use (a flag marks it stale), so code outside
the graph reads what upstream would have.

A layer whose cache is longer than its window (long prompts on gpt-oss's
128-token window or Gemma 3's 512/1024) rolls its buffer, and where it rolls
depends on the count: it keeps upstream's path, one graph per decode step
(``accelerate-neuron simulate`` names it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

#: Set on a layer whose Python counter a traced update left behind its tensors.
STALE = "_accelerate_neuron_stale_count"
#: Set at construction: the layer's cache fits its window (it never slides).
FITS = "_accelerate_neuron_fits_window"


def _legacy(original: Callable[..., Any]) -> bool:
    """Transformers 4.57: ``update(key, value, cache_kwargs)`` with positions in ``cache_kwargs``."""
    return "cache_kwargs" in inspect.signature(original).parameters


def _traced_fit(layer: Any, key_states: Any = None) -> bool:
    import torch

    if not torch.compiler.is_compiling() or not layer.__dict__.get(FITS, False):
        return False
    device = key_states.device if key_states is not None else getattr(layer, "device", None)
    return getattr(device, "type", None) == "neuron"


def _sync(layer: Any, legacy: bool) -> None:
    """Bring the Python counter up to date after traced updates (eager code reads it)."""
    if not layer.__dict__.get(STALE, False):
        return
    if legacy:
        # 4.57 keeps no tensor count; the positions written are what StaticLayer.get_seq_length counts too.
        layer.cumulative_length = int(layer.keys[0, 0].any(dim=-1).sum()) if layer.is_initialized else 0
    else:
        layer.cumulative_length_int = int(layer.cumulative_length)
    layer.__dict__[STALE] = False


def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, max_cache_len: int, sliding_window: int, *args: Any, **kwargs: Any) -> None:
        original(self, max_cache_len, sliding_window, *args, **kwargs)
        self.__dict__[FITS] = max_cache_len <= sliding_window

    return __init__


def wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    legacy = _legacy(original)

    def update(self: Any, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        if not _traced_fit(self, key_states):
            _sync(self, legacy)
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            if legacy:
                self.lazy_initialization(key_states)
            else:
                self.lazy_initialization(key_states, value_states)
        length = key_states.shape[-2]
        if legacy:
            cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
            position = cache_kwargs.get("cache_position") if cache_kwargs is not None else None
            if position is None:
                position = torch.arange(length, device=self.device)
        else:
            position = torch.arange(length, device=self.device) + self.cumulative_length
        self.keys.index_copy_(2, position, key_states)
        self.values.index_copy_(2, position, value_states)
        if not legacy:
            self.cumulative_length.add_(length)
        self.__dict__[STALE] = True  # a write, never a read: no guard on the count
        return self.keys, self.values

    return update


def wrap_get_mask_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    legacy = _legacy_mask(original)

    def get_mask_sizes(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _traced_fit(self):
            return self.max_cache_len, 0  # the window holds every position: the whole buffer, from position 0
        _sync(self, legacy)
        return original(self, *args, **kwargs)

    return get_mask_sizes


def _legacy_mask(original: Callable[..., Any]) -> bool:
    return "cache_position" in inspect.signature(original).parameters


def wrap_get_seq_length(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_seq_length(self: Any, *args: Any, **kwargs: Any) -> Any:
        legacy = not hasattr(self, "cumulative_length_int")
        if _traced_fit(self):
            if not self.is_initialized:
                return 0
            # As StaticLayer answers: a tensor, so positions built from it need no guard.
            return self.keys[0, 0].any(dim=-1).sum() if legacy else self.cumulative_length
        _sync(self, legacy)
        return original(self, *args, **kwargs)

    return get_seq_length


def wrap_crop(original: Callable[..., Any]) -> Callable[..., Any]:
    def crop(self: Any, tokens_to_remove: int) -> None:
        _sync(self, not hasattr(self, "cumulative_length_int"))
        return original(self, tokens_to_remove)

    return crop
