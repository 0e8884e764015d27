"""``accelerate_neuron.precompile(...)``: the warm-up in this process, for a model's generate() or a Trainer."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from .. import precompile_session as session
from . import apply_patches, training


def _ints(value: int | Sequence[int], name: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"precompile({name}={value!r}): expected a positive int or a non-empty list of positive ints")
    return values


def _token(model: Any) -> int:
    """A token id that is not the pad token (its value never changes a shape)."""
    pad = getattr(model.config, "pad_token_id", None)
    vocab = getattr(model.config, "vocab_size", None) or 2
    return next(
        t for t in (getattr(model.config, "bos_token_id", None), 1, 2) if isinstance(t, int) and t != pad and t < vocab
    )


def _generate(
    model: Any,
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    max_new_tokens: Sequence[int],
    generate_kwargs: dict[str, Any],
) -> None:

    token = _token(model)
    # Upstream sizes a static cache by the calls before it too (5.x: the largest length so far; 4.x: a cached
    # cache reused while it is large enough): the warm-up starts from the model's history and puts it back,
    # so the calls that follow see what they would have seen without it.
    history = {k: model.__dict__[k] for k in _CACHE_HISTORY if k in model.__dict__}
    try:
        _generate_all(model, token, prompt_lengths, batch_sizes, max_new_tokens, generate_kwargs)
    finally:
        for key in _CACHE_HISTORY:
            model.__dict__.pop(key, None)
        model.__dict__.update(history)


_CACHE_HISTORY = ("_previous_max_cache_length", "_cache")


def _generate_all(
    model: Any,
    token: int,
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    max_new_tokens: Sequence[int],
    generate_kwargs: dict[str, Any],
) -> None:
    import torch

    for batch in batch_sizes:
        for length in prompt_lengths:
            for new in max_new_tokens:
                ids = torch.full((batch, length), token, dtype=torch.long)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                model.generate(**inputs, max_new_tokens=new, **generate_kwargs)


@contextlib.contextmanager
def _out_of_the_way(trainer: Any) -> Iterator[None]:
    """A Trainer built outside the warm-up: scratch output folder and no reporting callbacks for the block."""
    args = trainer.args
    scratch = tempfile.mkdtemp(prefix="accelerate-neuron-precompile-")
    kept = (args.output_dir, getattr(args, "logging_dir", None))
    reporters = [
        c for c in trainer.callback_handler.callbacks if type(c).__module__.startswith("transformers.integrations")
    ]
    args.output_dir = scratch
    if kept[1] is not None:
        args.logging_dir = scratch
    for callback in reporters:
        trainer.remove_callback(callback)
    try:
        yield
    finally:
        args.output_dir = kept[0]
        if kept[1] is not None:
            args.logging_dir = kept[1]
        for callback in reporters:
            trainer.add_callback(callback)
        trainer.__dict__.pop(training._KEPT, None)  # the kept batches hold device memory
        shutil.rmtree(scratch, ignore_errors=True)


def precompile(
    target: Any,
    *,
    prompt_lengths: int | Sequence[int] = (),
    batch_sizes: int | Sequence[int] = 1,
    max_new_tokens: int | Sequence[int] = 32,
    evaluate: bool = True,
    **generate_kwargs: Any,
) -> dict[str, Any]:
    """Warm ``target`` in this process (one worker); returns the shapes found and warmed.

    ``target`` a model: ``generate()`` for every (batch size, prompt length, max_new_tokens), with
    ``generate_kwargs``; a ``Trainer``: one epoch over one batch per shape, ``evaluate()`` too if it has
    an eval dataset and ``evaluate`` is true.
    """
    from ...plugins import manager

    info = manager().infos.get("warmup")
    if info is not None and not info.active:
        raise RuntimeError(f"precompile() needs the built-in 'warmup' plugin, which is off here ({info.detail})")
    is_trainer = hasattr(target, "train") and hasattr(target, "get_train_dataloader")
    if not is_trainer and not hasattr(target, "generate"):
        raise TypeError(
            f"precompile() takes a model with generate() or a transformers Trainer, not {type(target).__name__}"
        )
    apply_patches(training_too=is_trainer)
    with session.warming_up() as warm:
        if is_trainer:
            with _out_of_the_way(target):
                target.train()
                if evaluate and getattr(target, "eval_dataset", None) is not None:
                    target.evaluate()
        else:
            lengths = _ints(prompt_lengths, "prompt_lengths")
            _generate(
                target,
                lengths,
                _ints(batch_sizes, "batch_sizes"),
                _ints(max_new_tokens, "max_new_tokens"),
                generate_kwargs,
            )
    return {"shapes": len(warm.seen), "warmed": len(warm.ran), "shape_list": list(warm.seen)}
