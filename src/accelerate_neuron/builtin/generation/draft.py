"""The draft model of a speculative call on Neuron: upstream's candidate generator drives it, a runner runs it.

Upstream's candidate generators (same tokenizer, different tokenizers, speculative sampling) call the assistant's
own ``generate()`` for every round of candidates, with the cache they got back from the previous round, and crop
that cache to what the target accepted. Their logic (how many candidates, the confidence threshold, the
re-tokenization between vocabularies, the logits processors and stopping criteria of the draft) is kept as is;
what changes for one speculative call:

- the generator sees the draft through :class:`HostView`: the model, with the host as its device, so the ids,
  masks and re-tokenized sequences it builds every round stay on the host (on the device each new length would
  be a new op shape);
- the cache it threads through the rounds is a :class:`~.rollback.PositionCache` over the draft's
  :class:`~.rollback.Runner`, and the draft's forward (an instance attribute for the call, see :func:`drafting`)
  hands every forward that carries one to the runner: a static cache, compiled forwards at bucketed widths.

A forward of the draft without a position cache (the user calling it meanwhile) runs as it always does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import overrides
from . import rollback

_FLAG = "_accelerate_neuron_draft_forward"
_CACHE_KWARGS = ("cache", "past_key_values")
_drafting: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "accelerate_neuron_drafting", default=frozenset()
)


def is_drafting(model: Any) -> bool:
    """Whether ``model`` is the draft of a speculative call running in this context."""
    return id(model) in _drafting.get()


def own_forward(model: Any) -> Callable[..., Any]:
    """``model.forward`` beneath this module's wrapper, if one is installed (what a runner compiles)."""
    current = model.forward
    return getattr(current, "inner", current) if getattr(current, _FLAG, False) else current


@contextlib.contextmanager
def drafting(model: Any) -> Iterator[None]:
    """For one speculative call: ``model``'s forwards that carry a position cache run on its runner."""

    def build(inner: Any) -> Any:
        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            position = next((kwargs[k] for k in _CACHE_KWARGS if rollback.is_position_cache(kwargs.get(k))), None)
            if position is None:
                return inner(*args, **kwargs)
            return _run(position, args, kwargs)

        forward.inner = inner
        return forward

    with overrides.overridden(model, "forward", _FLAG, build):
        token = _drafting.set(_drafting.get() | {id(model)})
        try:
            yield
        finally:
            _drafting.reset(token)


def _run(position: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One draft forward of upstream's loop on the runner: the logits of its last token, the position cache."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or kwargs.get("inputs_embeds") is not None:
        raise ValueError("accelerate_neuron: a speculative draft forward needs input_ids (not inputs_embeds)")
    mask = kwargs.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    logits = position.runner.forward(ids, mask, rollback.KEEP_LAST)
    return _output(logits, position)


@functools.lru_cache(maxsize=1)
def _output_class() -> tuple[type, str]:
    from dataclasses import fields

    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in fields(CausalLMOutputWithPast)}
    return CausalLMOutputWithPast, "cache" if "cache" in names else "past_key_values"


def _output(logits: torch.Tensor, position: Any) -> Any:
    cls, cache_field = _output_class()
    return cls(logits=logits, **{cache_field: position})


class HostView:
    """The draft model as a candidate generator sees it for one call: every attribute the model's, but its
    ``device`` the host, so what the generator builds each round (ids, masks, re-tokenized sequences) is built on
    the host. Its ``generate`` is the model's own."""

    def __init__(self, model: Any) -> None:
        object.__setattr__(self, "_model", model)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_model"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_model"), name, value)
