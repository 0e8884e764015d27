"""Static training shapes without script edits: the length-bucket policy and the padding of one batch.

Every distinct (batch, length) a training step sees on Neuron is a new compile
(minutes each; eager mode compiles op by op per shape too). Collators pad each
batch to its own longest sample, so a run over variable-length text compiles a
graph per length. A batch is padded further, on the right, to the next length
of a small bucket set: ``attention_mask`` (and completion/assistant masks) with
0 and ``labels`` with -100, so the model never attends to the added positions
and the loss ignores them (the loss is unchanged; padding on the right keeps
every real token at its position, which matters for absolute position
embeddings; a causal model's real tokens never see the pad after them).
Where batches are padded: :mod:`.batches` (every dataloader Accelerate
prepares on Neuron, the Trainer's included) with :mod:`.collate`.

The buckets come from the ``train_buckets`` setting (:mod:`accelerate_neuron.settings`:
the environment, then a config file, then the ``neuron_training_shape_policy``
hook, then the built-in powers of two from 64 up to the model's maximum
length), capped at that length; the hook also answers the rest of the policy.
The bucket type, the pad values and the model's limit are the shape layer's
(:mod:`..shapes`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import logs, settings
from ..shapes import Buckets, from_spec, hook_answer, known_key, max_positions, pad_columns, pow2

logger = logging.getLogger(__name__)

BUCKETS_ENV = settings.env_name("train_buckets")
MIN_BUCKET = 64
FALLBACK_MAX_LENGTH = 8192
_POLICY_KEYS = ("buckets", "pad_to_multiple_of", "drop_last", "pad_values")

#: Keys of a padding-free batch (sequences flattened into one row, boundaries in ``position_ids``): its length is the
#: batch's token count and these describe the boundaries, so it is left as it is (TRL's ``pad_to_multiple_of``).
FLATTENED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


@dataclass(frozen=True)
class ShapePolicy:
    """How training batches are padded on Neuron (see ``neuron_training_shape_policy``)."""

    buckets: Buckets
    pad_to_multiple_of: int | None = None
    drop_last: bool = True
    pad_values: Mapping[str, int | float] = field(default_factory=dict)
    source: str = "built-in default"
    explicit: bool = False  # the buckets are the user's own choice (environment or config file)

    def __post_init__(self) -> None:  # plain lists are accepted (a plugin's, a test's): checked as buckets
        object.__setattr__(self, "buckets", Buckets(self.buckets, "train_buckets"))

    @property
    def active(self) -> bool:
        return bool(self.buckets) or self.pad_to_multiple_of is not None

    def target_length(self, length: int, multiple: int | None = None) -> int:
        """The padded length of a batch whose longest sample has ``length`` tokens."""
        target = self.buckets.at_least(length)
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


def pow2_buckets(max_length: int | None) -> Buckets:
    """Powers of two from 64 up to ``max_length``, and ``max_length`` itself."""
    return pow2(MIN_BUCKET, max_length if max_length and max_length > 0 else FALLBACK_MAX_LENGTH, "train_buckets")


def default_policy(max_length: int | None) -> dict[str, Any]:
    """Powers of two from 64 up to ``max_length`` (and ``max_length`` itself), drop_last on."""
    return {"buckets": list(pow2_buckets(max_length)), "pad_to_multiple_of": None, "drop_last": True, "pad_values": {}}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} = {value!r}: expected a positive int")
    return value


def _validate(answer: Mapping[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(answer) - set(_POLICY_KEYS))
    if unknown:
        raise ValueError(f"{source} has unknown key(s) {unknown}; allowed: {list(_POLICY_KEYS)}")
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


def resolve_policy(max_length: int | None, record: str | None = None) -> ShapePolicy:
    """The shape policy for a model of ``max_length`` tokens (buckets: the ``train_buckets`` setting, capped at
    ``max_length``; ``record``: the model's shape record, for ``fit``)."""
    merged = _validate(default_policy(max_length), "the built-in policy")
    source = "built-in default"
    answer = hook_answer("neuron_training_shape_policy", _POLICY_KEYS, max_length=max_length)
    if answer:
        if answer != default_policy(max_length):
            source = "neuron_training_shape_policy hook"
        merged.update(_validate(answer, "neuron_training_shape_policy"))
    chosen = settings.explicit("train_buckets")
    if chosen is not None:
        merged["buckets"] = from_spec(chosen.value, "train_buckets", lambda: pow2_buckets(max_length), record)
        source = chosen.describe()
        if not merged["buckets"]:
            merged["pad_to_multiple_of"] = None
    merged["buckets"] = Buckets(merged["buckets"], "train_buckets").capped(max_length, "maximum length")
    return ShapePolicy(source=source, explicit=chosen is not None, **merged)


def model_max_length(model: Any) -> int | None:
    """The longest sequence the model's position embeddings allow (None if unbounded/unknown)."""
    return max_positions(model) if model is not None else None


def tokenizer_max_length(tokenizer: Any) -> int | None:
    value = getattr(getattr(tokenizer, "tokenizer", tokenizer), "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None


def max_length_of(*limits: int | None) -> int | None:
    """The tightest of the known limits (the model's positions, the tokenizer's maximum), or None."""
    known = [n for n in limits if n]
    return min(known) if known else None


def pad_batch(batch: Any, policy: ShapePolicy, pad_values: Mapping[str, Any], multiple: int | None = None) -> Any:
    """Right-pad every known sequence key of ``batch`` (dim 1) to the policy's length, in place.

    All or nothing: a batch with a sequence-shaped key of unknown pad value (one warning naming it), or a
    padding-free batch, is returned as it is, so every key keeps the length the others have.
    """
    import torch

    if not isinstance(batch, Mapping) or any(k in batch for k in FLATTENED_KEYS):
        return batch
    targets: dict[str, int] = {}
    for key, value in batch.items():
        if key in pad_values and _sequence_shaped(key, value, torch):
            target = policy.target_length(value.shape[1], multiple)
            if target != value.shape[1]:
                targets[key] = target
    if not targets:
        return batch
    changed = {batch[k].shape[1] for k in targets}
    unknown = sorted(
        key
        for key, value in batch.items()
        if key not in pad_values and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] in changed
    )
    if unknown:
        if logs.first(("training.unknown_key", tuple(unknown))):
            logger.warning(
                "accelerate_neuron: batch key(s) %s have the sequence length but no known pad value, so these "
                "batches are not padded to length buckets (each new length compiles a new graph); declare them "
                "with a neuron_training_shape_policy hook returning {'pad_values': {%r: <value>}}",
                unknown,
                unknown[0],
            )
        return batch
    for key, target in targets.items():
        batch[key] = pad_columns(batch[key], target, pad_values[key], dim=1)
    return batch


def _sequence_shaped(key: str, value: Any, torch: Any) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    # Float labels of shape (batch, classes) are multi-label targets, not a sequence.
    return not (known_key(key) == "labels" and value.is_floating_point())
