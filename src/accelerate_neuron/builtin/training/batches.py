"""Every dataloader Accelerate prepares on Neuron yields batches on the length buckets, whatever collator built them.

The ``Trainer`` (and TRL's trainers, which are Trainers), and plain Accelerate
loops all hand their ``DataLoader`` to ``Accelerator.prepare``, which builds a
``DataLoaderShard`` / ``DataLoaderDispatcher`` through
``Accelerator.prepare_data_loader``: one boundary every training batch
crosses. On a Neuron device the prepared loader's ``collate_fn`` (on the torch
``DataLoader`` Accelerate keeps inside) is wrapped in a
:class:`~.collate.BucketingCollator`, so padding runs on the host, in the
process that collates (worker or main), before the batch is moved to the core:
no device op ever depends on the unpadded length.

The plan (policy and pad values) comes from the Trainer when it prepares its
own dataloaders (:func:`trainer_plan`: its model's maximum length, its
tokenizer, a resumed checkpoint's buckets); a plain loop's plan is resolved on
the first batch, from the models the accelerator prepared by then.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import Any

from ... import device, logs
from ..shapes import record_key
from .collate import BucketingCollator, Plan, already_static, collator_name, collator_tokenizer, pad_values_for
from .shapes import BUCKETS_ENV, ShapePolicy, max_length_of, model_max_length, resolve_policy, tokenizer_max_length

logger = logging.getLogger(__name__)

#: The plan of the Trainer preparing its dataloader right now (set by :func:`trainer_plan`).
_TRAINER_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("accelerate_neuron_plan", default=None)


@contextlib.contextmanager
def trainer_plan(plan: Plan) -> Iterator[None]:
    """Dataloaders prepared inside this block are padded with ``plan`` (the Trainer's)."""
    token = _TRAINER_PLAN.set(plan)
    try:
        yield
    finally:
        _TRAINER_PLAN.reset(token)


def wrap_prepare_data_loader(original: Any) -> Any:
    @functools.wraps(original)
    def prepare_data_loader(self: Any, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = original(self, data_loader, *args, **kwargs)
        try:
            bucket(self, prepared)
        except ValueError:
            raise  # a bad policy setting: the message names it
        except Exception:
            logger.warning("accelerate_neuron: batches keep the collator's shapes (shape policy failed)", exc_info=True)
        return prepared

    return prepare_data_loader


def bucket(accelerator: Any, prepared: Any) -> BucketingCollator | None:
    """Wrap the collate_fn of a dataloader ``accelerator`` prepared (on Neuron); returns the wrapper, or None."""
    if not device.is_neuron(getattr(accelerator, "device", None)):
        return None
    # DataLoaderAdapter (Accelerate >= 0.33) keeps the torch DataLoader it iterates as base_dataloader.
    loader = getattr(prepared, "base_dataloader", prepared)
    collate = getattr(loader, "collate_fn", None)
    if collate is None or isinstance(collate, BucketingCollator):
        return None
    given = _TRAINER_PLAN.get()
    policy = given.policy if given is not None else resolve_policy(None)  # a bad setting fails here, not mid-epoch
    if not policy.active:
        return None
    reason = already_static(collate)
    if reason is not None:
        logger.debug("accelerate_neuron: %s left alone: %s", collator_name(collate), reason)
        return None
    name = collator_name(collate)
    if given is not None:
        announce(name, given.policy)
        wrapped = BucketingCollator(collate, plan=given)
    else:
        ref = weakref.ref(accelerator)
        wrapped = BucketingCollator(
            collate, resolve=lambda: loop_plan(ref(), collate), on_first=lambda plan: announce(name, plan.policy)
        )
    # torch's DataLoader allows collate_fn to change after __init__; each new iterator reads it.
    loader.collate_fn = wrapped
    return wrapped


def loop_plan(accelerator: Any, collate: Any) -> Plan:
    """A plain loop's plan: buckets capped by the prepared models' and the tokenizer's maximum lengths."""
    models = list(getattr(accelerator, "_models", None) or ()) if accelerator is not None else []
    unwrapped = [_unwrap(accelerator, m) for m in models]
    limit = max_length_of(*(model_max_length(m) for m in unwrapped), tokenizer_max_length(collator_tokenizer(collate)))
    config = next((m.config for m in unwrapped if getattr(m, "config", None) is not None), None)
    record = record_key(config) if config is not None else None
    policy = resolve_policy(limit, record)
    return Plan(policy, pad_values_for(collate, policy, config=config), record)


def _unwrap(accelerator: Any, model: Any) -> Any:
    try:
        return accelerator.unwrap_model(model)
    except Exception:
        return model


def announce(name: str, policy: ShapePolicy) -> None:
    targets = []
    if policy.buckets:
        targets.append(f"the length buckets {list(policy.buckets)}")
    if policy.pad_to_multiple_of:
        beyond = " beyond the last bucket" if policy.buckets else ""
        targets.append(f"a multiple of {policy.pad_to_multiple_of}{beyond}")
    logs.once(
        logger,
        ("training.buckets", name, policy.buckets, policy.pad_to_multiple_of),
        "accelerate_neuron: training runs on Neuron, so batches from %s are padded on the right to %s "
        "(%s; attention_mask 0, labels -100: the loss is unchanged), keeping the compiled step to a few shapes. "
        "Opt out: %s=off, or choose the buckets, e.g. %s=128,256,512.",
        name,
        " and ".join(targets),
        policy.source,
        BUCKETS_ENV,
        BUCKETS_ENV,
    )
