"""A dataloader's ``collate_fn`` whose batches land on the length buckets, whatever collator it wraps.

:class:`BucketingCollator` calls the collator the script chose (Transformers',
TRL's, PEFT examples', a function of the user's) and right-pads the batch it
returns with :func:`.shapes.pad_batch`. Its plan (the policy and the pad value
of each key) may be resolved on the first batch rather than when the
dataloader is prepared: a plain Accelerate script often prepares the
dataloader before the model, and the model's maximum length caps the buckets.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import logs
from ... import padding as _padding
from ..shapes import note, pad_id, pad_values
from .shapes import ShapePolicy, pad_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How one dataloader's batches are padded: the policy, and each key's pad value."""

    policy: ShapePolicy
    pad_values: Mapping[str, Any]
    record: str | None = None  # the model's shape record: the batch lengths it sees, for fitted buckets


def _inner(collator: Any) -> list[Any]:
    """``collator`` and what it wraps (Trainer's RemoveColumnsCollator, functools.partial)."""
    chain = [collator]
    for _ in range(4):
        inner = getattr(chain[-1], "data_collator", None) or getattr(chain[-1], "func", None)
        if inner is None or inner in chain:
            break
        chain.append(inner)
    return chain


def collator_attr(collator: Any, *names: str) -> Any:
    """The first attribute (or partial keyword) among ``names`` found on ``collator`` or what it wraps."""
    for obj in _inner(collator):
        keywords = getattr(obj, "keywords", None) if isinstance(obj, functools.partial) else None
        for name in names:
            value = keywords.get(name) if keywords else getattr(obj, name, None)
            if value is not None:
                return value
    return None


def collator_tokenizer(collator: Any) -> Any:
    return collator_attr(collator, "tokenizer", "processing_class")


def already_static(collator: Any) -> str | None:
    """Why the collator's batches need no buckets (None if they may)."""
    padding = collator_attr(collator, "padding")
    padding = getattr(padding, "value", padding)
    if padding in (False, "do_not_pad"):
        return "it does not pad (padding=False)"
    max_length = collator_attr(collator, "max_length")
    if padding == "max_length" and max_length:
        return f"it pads to max_length={max_length}"
    return None


def pad_values_for(collator: Any, policy: ShapePolicy, tokenizer: Any = None, config: Any = None) -> dict[str, Any]:
    """Each known key's pad value: the pad token from the tokenizer, the collator (TRL) or the model's config.

    The value under ``input_ids`` is never attended to nor counted in the loss (mask 0, label -100); it only has
    to be a valid id, so 0 stands in when nothing names a pad token.
    """
    tokenizer = tokenizer if tokenizer is not None else collator_tokenizer(collator)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    token = pad_id(
        tokenizer, collator_attr(collator, "pad_token_id"), config, vocab=getattr(config, "vocab_size", None)
    )
    values: dict[str, Any] = pad_values(token, pad_type=getattr(tokenizer, "pad_token_type_id", 0) or 0)
    label_pad = collator_attr(collator, "label_pad_token_id")
    if isinstance(label_pad, int):
        values["labels"] = values["decoder_labels"] = label_pad
    values.update(policy.pad_values)
    return values


class BucketingCollator:
    """Wraps a collator: its batches are right-padded to the policy's lengths.

    ``plan`` is fixed, or ``resolve`` computes it on the first batch (``on_first`` then hears it), or when the
    collator is pickled for a worker process.
    """

    def __init__(
        self,
        collator: Callable[[list[Any]], Any],
        plan: Plan | None = None,
        resolve: Callable[[], Plan] | None = None,
        on_first: Callable[[Plan], None] | None = None,
    ) -> None:
        if plan is None and resolve is None:
            raise ValueError("BucketingCollator needs a plan or a way to resolve one")
        self.collator = collator
        self._plan = plan
        self._resolve = resolve
        self._on_first = on_first
        multiple = collator_attr(collator, "pad_to_multiple_of")
        self.multiple = multiple if isinstance(multiple, int) and multiple > 0 else None

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            assert self._resolve is not None
            self._plan = self._resolve()
            self._resolve = None
            if self._on_first is not None:
                on_first, self._on_first = self._on_first, None
                on_first(self._plan)
        return self._plan

    @property
    def policy(self) -> ShapePolicy:
        return self.plan.policy

    def __call__(self, features: list[Any]) -> Any:
        batch = self.collator(features)
        try:
            plan = self.plan
            real = _real_tokens(batch)
            if real is not None:
                rows, length = batch["input_ids"].shape
                note(plan.record, "train_buckets", length, rows)
            padded = pad_batch(batch, plan.policy, plan.pad_values, self.multiple)
            if real is not None:
                _padding.add("training", padded["input_ids"].numel(), real)
            return padded
        except ValueError:
            raise  # a bad setting: the message names it
        except Exception:  # an unpadded batch costs a compile; a crash costs the run
            if logs.first(("training.pad_failed", type(self.collator).__name__)):
                logger.warning("accelerate_neuron: could not pad a batch to the length buckets", exc_info=True)
            return batch

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes get a pickled copy: resolve here, where the models are known.
        state = dict(self.__dict__)
        state["_plan"], state["_resolve"], state["_on_first"] = self.plan, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:  # the wrapped collator's attributes (tokenizer, ...)
        if name.startswith("_") or name == "collator":  # own state, not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __repr__(self) -> str:
        return f"BucketingCollator({self.collator!r})"


def _real_tokens(batch: Any) -> int | None:
    """The tokens of a batch its attention mask keeps (all of ``input_ids`` without one); None: not a token batch."""
    import torch

    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    mask = batch.get("attention_mask")
    return int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else ids.numel()


def bucketing_collator(
    collator: Any, policy: ShapePolicy, pad_values: Mapping[str, Any] | None = None
) -> BucketingCollator | None:
    """``collator`` wrapped for ``policy``, or None (already wrapped, static, or the policy is off)."""
    if isinstance(collator, BucketingCollator) or not policy.active:
        return None
    reason = already_static(collator)
    if reason is not None:
        logger.debug("accelerate_neuron: %s left alone: %s", collator_name(collator), reason)
        return None
    values = dict(pad_values) if pad_values is not None else pad_values_for(collator, policy)
    return BucketingCollator(collator, Plan(policy, values))


def collator_name(collator: Any) -> str:
    inner = _inner(collator)[-1]
    return getattr(inner, "__qualname__", None) or type(inner).__name__


__all__ = ["BucketingCollator", "Plan", "already_static", "bucketing_collator", "pad_values_for"]
