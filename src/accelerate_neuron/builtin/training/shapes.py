"""Static training shapes without script edits: pad stock collators' batches to length buckets.

Every distinct (batch, length) a compiled training step sees is a new Neuron
compile (minutes each). Stock collators pad each batch to its own longest
sample, so a run over variable-length text compiles a graph per length. Here
the batch a stock collator produced is padded further, on the right, to the
next length of a small bucket set: ``attention_mask`` with 0 and ``labels``
with -100, so the model never attends to the added positions and the loss
ignores them (the loss is unchanged; padding on the right keeps every real
token at its position, which matters for absolute position embeddings).

The buckets come from the ``train_buckets`` setting (:mod:`accelerate_neuron.settings`:
the environment, then a config file, then the ``neuron_training_shape_policy``
hook, then the built-in powers of two from 64 up to the model's maximum
length); the hook also answers the rest of the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import logs, settings

logger = logging.getLogger(__name__)

BUCKETS_ENV = settings.env_name("train_buckets")
MIN_BUCKET = 64
FALLBACK_MAX_LENGTH = 8192
_POLICY_KEYS = ("buckets", "pad_to_multiple_of", "drop_last", "pad_values")

#: Pad value of each sequence-shaped batch key; ``"pad"`` means the tokenizer's pad token id.
PAD_VALUES: dict[str, Any] = {
    "input_ids": "pad",
    "decoder_input_ids": "pad",
    "attention_mask": 0,
    "decoder_attention_mask": 0,
    "labels": -100,
    "token_type_ids": "pad_type",
    "special_tokens_mask": 1,
    "position_ids": 0,
}

_COLLATOR_NAMES = (
    "DataCollatorWithPadding",
    "DataCollatorForSeq2Seq",
    "DataCollatorForLanguageModeling",
    "DataCollatorForTokenClassification",
)


@dataclass(frozen=True)
class ShapePolicy:
    """How training batches are padded on Neuron (see ``neuron_training_shape_policy``)."""

    buckets: tuple[int, ...]
    pad_to_multiple_of: int | None = None
    drop_last: bool = True
    pad_values: Mapping[str, int | float] = field(default_factory=dict)
    source: str = "built-in default"
    explicit: bool = False  # the buckets are the user's own choice (environment or config file)

    @property
    def active(self) -> bool:
        return bool(self.buckets) or self.pad_to_multiple_of is not None

    def target_length(self, length: int, multiple: int | None = None) -> int:
        """The padded length of a batch whose longest sample has ``length`` tokens."""
        target = next((b for b in self.buckets if b >= length), None)
        if target is None:
            step = self.pad_to_multiple_of
            target = -(-length // step) * step if step else length
        if multiple:
            target = -(-target // multiple) * multiple
        return target

    def is_target(self, length: int) -> bool:
        """Whether ``length`` is a length this policy pads to (a bucket, or a multiple beyond the last)."""
        if length in self.buckets:
            return True
        step = self.pad_to_multiple_of
        beyond = not self.buckets or length > self.buckets[-1]
        return bool(step) and beyond and length % step == 0


def pow2_buckets(max_length: int | None) -> list[int]:
    """Powers of two from 64 up to ``max_length``, and ``max_length`` itself."""
    limit = max_length if max_length and max_length > 0 else FALLBACK_MAX_LENGTH
    buckets = []
    size = MIN_BUCKET
    while size < limit:
        buckets.append(size)
        size *= 2
    buckets.append(limit)
    return buckets


def default_policy(max_length: int | None) -> dict[str, Any]:
    """Powers of two from 64 up to ``max_length`` (and ``max_length`` itself), drop_last on."""
    return {"buckets": pow2_buckets(max_length), "pad_to_multiple_of": None, "drop_last": True, "pad_values": {}}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} = {value!r}: expected a positive int")
    return value


def _validate(answer: Mapping[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(answer) - set(_POLICY_KEYS))
    if unknown:
        raise ValueError(f"{source} returned unknown key(s) {unknown}; allowed: {list(_POLICY_KEYS)}")
    out: dict[str, Any] = {}
    if "buckets" in answer:
        buckets = answer["buckets"]
        if buckets is None:
            buckets = ()
        if not isinstance(buckets, Iterable) or isinstance(buckets, str | bytes):
            raise ValueError(f"{source}['buckets'] = {buckets!r}: expected a list of positive ints")
        try:
            out["buckets"] = settings.parse_buckets(list(buckets))
        except ValueError:
            raise ValueError(
                f"{source}['buckets'] = {buckets!r}: expected strictly ascending positive ints (empty: off)"
            ) from None
    if "pad_to_multiple_of" in answer:
        step = answer["pad_to_multiple_of"]
        out["pad_to_multiple_of"] = None if step is None else _positive_int(step, f"{source}['pad_to_multiple_of']")
    if "drop_last" in answer:
        if not isinstance(answer["drop_last"], bool):
            raise ValueError(f"{source}['drop_last'] = {answer['drop_last']!r}: expected True or False")
        out["drop_last"] = answer["drop_last"]
    if "pad_values" in answer:
        values = answer["pad_values"] or {}
        if not isinstance(values, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in values.items()
        ):
            raise ValueError(f"{source}['pad_values'] = {values!r}: expected a dict of batch key -> number")
        out["pad_values"] = dict(values)
    return out


def resolve_policy(max_length: int | None) -> ShapePolicy:
    """The shape policy for a model of ``max_length`` tokens (buckets: the ``train_buckets`` setting)."""
    from ...plugins import call_hook

    merged = _validate(default_policy(max_length), "the built-in policy")
    source = "built-in default"
    answer = call_hook("neuron_training_shape_policy", max_length=max_length)
    if answer is not None:
        if not isinstance(answer, Mapping):
            raise ValueError(f"neuron_training_shape_policy returned {answer!r}; expected a dict or None")
        if answer != default_policy(max_length):
            source = "neuron_training_shape_policy hook"
        merged.update(_validate(answer, "neuron_training_shape_policy"))
    chosen = settings.explicit("train_buckets")
    if chosen is not None:
        spec = chosen.value
        merged["buckets"] = tuple(pow2_buckets(max_length)) if spec == settings.POW2 else spec
        source = chosen.describe()
        if not merged["buckets"]:
            merged["pad_to_multiple_of"] = None
    return ShapePolicy(source=source, explicit=chosen is not None, **merged)


# ---------------------------------------------------------------- collators


def _stock_collator_types() -> tuple[type, ...]:
    try:
        from transformers import data as hf_data
    except Exception:
        return ()
    return tuple(t for t in (getattr(hf_data.data_collator, n, None) for n in _COLLATOR_NAMES) if isinstance(t, type))


def _already_static(collator: Any) -> str | None:
    """Why the collator's batches need no buckets (None if they do)."""
    padding = getattr(collator, "padding", True)
    padding = getattr(padding, "value", padding)
    if padding in (False, "do_not_pad"):
        return "it does not pad (padding=False)"
    if padding == "max_length" and getattr(collator, "max_length", None):
        return f"it pads to max_length={collator.max_length}"
    return None


def _tokenizer_max_length(tokenizer: Any) -> int | None:
    value = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None


def collator_max_length(collator: Any, model_max_length: int | None) -> int | None:
    lengths = [n for n in (model_max_length, _tokenizer_max_length(getattr(collator, "tokenizer", None))) if n]
    return min(lengths) if lengths else None


class BucketingCollator:
    """Wraps a stock collator: its batches are right-padded to the policy's lengths."""

    def __init__(
        self, collator: Callable[[list[Any]], Any], policy: ShapePolicy, pad_values: Mapping[str, Any]
    ) -> None:
        self.collator = collator
        self.policy = policy
        self.pad_values = dict(pad_values)
        self.multiple = getattr(collator, "pad_to_multiple_of", None)

    def __call__(self, features: list[Any]) -> Any:
        batch = self.collator(features)
        try:
            return pad_batch(batch, self.policy, self.pad_values, self.multiple)
        except Exception:  # an unpadded batch costs a compile; a crash costs the run
            if logs.first(("training.pad_failed", type(self.collator).__name__)):
                logger.warning("accelerate_neuron: could not pad a batch to the length buckets", exc_info=True)
            return batch

    def __getattr__(self, name: str) -> Any:  # the wrapped collator's attributes (tokenizer, ...)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __repr__(self) -> str:
        return f"BucketingCollator({self.collator!r}, buckets={list(self.policy.buckets)})"


def pad_values_for(collator: Any, policy: ShapePolicy) -> dict[str, Any]:
    tokenizer = getattr(collator, "tokenizer", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        config = getattr(getattr(collator, "model", None), "config", None)
        pad_id = getattr(config, "pad_token_id", None)
    pad_type = getattr(tokenizer, "pad_token_type_id", 0) or 0
    values: dict[str, Any] = {}
    for key, value in PAD_VALUES.items():
        if value == "pad":
            value = pad_id if pad_id is not None else 0
        elif value == "pad_type":
            value = pad_type
        values[key] = value
    values["labels"] = getattr(collator, "label_pad_token_id", -100)
    values.update(policy.pad_values)
    return values


def bucketing_collator(collator: Any, policy: ShapePolicy) -> BucketingCollator | None:
    """``collator`` wrapped for ``policy``, or None (not a stock padding collator, or already static)."""
    if isinstance(collator, BucketingCollator) or not policy.active:
        return None
    stock = _stock_collator_types()
    if not stock or not isinstance(collator, stock):
        if logs.first(("training.custom_collator", type(collator).__name__)):
            logger.info(
                "accelerate_neuron: %s is not a stock padding collator; its batches keep their shapes "
                "(pad them to a few fixed lengths yourself to avoid Neuron recompiles)",
                type(collator).__name__,
            )
        return None
    reason = _already_static(collator)
    if reason is not None:
        logger.debug("accelerate_neuron: %s left alone: %s", type(collator).__name__, reason)
        return None
    return BucketingCollator(collator, policy, pad_values_for(collator, policy))


def pad_batch(batch: Any, policy: ShapePolicy, pad_values: Mapping[str, Any], multiple: int | None = None) -> Any:
    """Right-pad every known sequence key of ``batch`` (dim 1) to the policy's length, in place."""
    import torch
    import torch.nn.functional as F

    if not isinstance(batch, Mapping):
        return batch
    targets: dict[str, int] = {}
    for key, value in batch.items():
        if key in pad_values and isinstance(value, torch.Tensor) and value.dim() >= 2:
            target = policy.target_length(value.shape[1], multiple)
            if target != value.shape[1]:
                targets[key] = target
    if not targets:
        return batch
    changed = {batch[k].shape[1] for k in targets}
    for key, value in batch.items():
        if key not in pad_values and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] in changed:
            if logs.first(("training.unknown_key", key)):
                logger.warning(
                    "accelerate_neuron: batch key %r has the sequence length but no known pad value, so batches "
                    "are not padded to length buckets; declare it with a neuron_training_shape_policy hook "
                    "returning {'pad_values': {%r: <value>}}",
                    key,
                    key,
                )
            return batch
    padded = {}
    for key, target in targets.items():
        value = batch[key]
        # F.pad lists (left, right) pairs from the last dimension backwards; only dim 1 grows.
        spec = [0, 0] * (value.dim() - 2) + [0, target - value.shape[1]]
        padded[key] = F.pad(value, spec, value=pad_values[key])
    for key, value in padded.items():  # all or nothing: every key keeps the same length
        batch[key] = value
    return batch
