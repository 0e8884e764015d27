"""Encoder-decoder ``generate()`` compiled on Neuron: the encoder and the first decoder step as graphs.

Upstream compiles only the decode steps after the first: the encoder (T5, BART, Whisper's audio encoder) and the
first decoder step, which also fills the cross-attention cache, run op by op, each op an eager compile and a launch
on Neuron (T5: 115 eager signatures per call). On Neuron, with a compiled decode:

- the encoder runs as one graph per (bucketed) input shape: its token input is right-padded to a prompt bucket
  (:func:`.padding.encoder_pad`), Whisper's log-mel window is a fixed size;
- the first decoder step runs through upstream's own compiled call, the one the later steps use: one graph more
  per cache bucket (its cross-attention cache is still empty, which the graph's guards tell apart).

Both go through ``nn.Module``'s own compiled-call slot (what ``Module.compile()`` fills): ``module(...)`` runs the
slot's function instead of the module's call, for one call only (the first step) or for the encoder's call, and the
slot is emptied afterwards. A module the caller compiled with ``Module.compile()`` keeps its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compile_options import compile_config

logger = logging.getLogger(__name__)

#: ``nn.Module.__call__`` runs this instead of the module's own call when it is set (``Module.compile()``).
_SLOT = "_compiled_call_impl"
#: Where the compiled encoder call is kept on the encoder module, with the config it was compiled with.
_ENCODER_ATTR = "_accelerate_neuron_compiled_encoder"


def _free(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and getattr(module, _SLOT, None) is None


def encoder_config(generation_config: Any) -> Any | None:
    """The compile config of the encoder's graph: the caller's ``compile_config`` or Neuron's defaults; None when
    the caller disabled compiling."""
    if generation_config is not None and getattr(generation_config, "disable_compile", False):
        return None
    given = getattr(generation_config, "compile_config", None)
    return given if given is not None else compile_config("generate")


def _compiled_encoder(encoder: torch.nn.Module, config: Any) -> Callable[..., Any]:
    """``encoder``'s call compiled with ``config``, kept on the encoder like upstream keeps ``_compiled_call``."""
    kept = encoder.__dict__.get(_ENCODER_ATTR)
    if kept is None or kept[0] != config:
        # The call without the slot (as Module.compile() compiles it): hooks and forward, not __call__ itself.
        kept = (config, torch.compile(encoder._call_impl, **config.to_dict()))
        encoder.__dict__[_ENCODER_ATTR] = kept
    return kept[1]


@contextlib.contextmanager
def encoder_compiled(model: Any, generation_config: Any) -> Iterator[None]:
    """For the block: ``model.get_encoder()(...)`` runs compiled (nothing changes if it cannot be)."""
    config = encoder_config(generation_config)
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if config is not None and callable(get_encoder) else None
    if encoder is None or not _free(encoder):
        yield
        return
    encoder.__dict__[_SLOT] = _compiled_encoder(encoder, config)
    try:
        yield
    finally:
        encoder.__dict__.pop(_SLOT, None)


def route_next_call(model: Any, fn: Callable[..., Any]) -> Callable[[], None]:
    """The next ``model(...)`` runs ``fn`` instead (once); returns what undoes it if that call never comes."""
    if not _free(model):
        return lambda: None

    def once(*args: Any, **kwargs: Any) -> Any:
        model.__dict__.pop(_SLOT, None)  # before the call: ``fn`` itself calls the model's own call
        return fn(*args, **kwargs)

    model.__dict__[_SLOT] = once

    def undo() -> None:
        if model.__dict__.get(_SLOT) is once:
            del model.__dict__[_SLOT]

    return undo
