"""The length-bucket policy travels with Trainer checkpoints, so a resumed run pads as the interrupted one did.

A checkpoint holds weights, optimizer, scheduler and RNG states; the shape
policy (:mod:`.shapes`) is resolved afresh by every run, from the environment,
the plugins and the model's maximum length. A resume under another policy (a
plugin upgraded, another tokenizer limit, ``ACCELERATE_NEURON_TRAIN_BUCKETS``
unset) pads its batches to other lengths: the resumed steps compile graphs the
first run never needed and their losses differ from an uninterrupted run's in
the last bits. So each checkpoint gets ``neuron_shape_policy.json`` (written
before ``trainer_state.json``, which marks the checkpoint complete), and a
resume adopts it, unless this run names its buckets explicitly in the
environment: that choice wins, with a warning that the resume is not exact.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ...files import write_atomically
from .shapes import BUCKETS_ENV, ShapePolicy, _validate

logger = logging.getLogger(__name__)

POLICY_FILE = "neuron_shape_policy.json"
_FIELDS = ("buckets", "pad_to_multiple_of", "drop_last", "pad_values")


def to_record(policy: ShapePolicy) -> dict[str, Any]:
    record: dict[str, Any] = {
        "buckets": list(policy.buckets),
        "pad_to_multiple_of": policy.pad_to_multiple_of,
        "drop_last": policy.drop_last,
        "pad_values": dict(policy.pad_values),
    }
    return {**record, "source": policy.source}


def same_shapes(a: ShapePolicy, b: ShapePolicy) -> bool:
    """Whether two policies pad every batch to the same shape (their sources may differ)."""
    return all(to_record(a)[k] == to_record(b)[k] for k in _FIELDS)


def save(policy: ShapePolicy, checkpoint: str | os.PathLike[str]) -> Path:
    """Write ``policy`` into ``checkpoint`` atomically (a kill mid-write leaves no torn file)."""
    return write_atomically(Path(checkpoint) / POLICY_FILE, json.dumps(to_record(policy), indent=2))


def load(checkpoint: str | os.PathLike[str]) -> ShapePolicy | None:
    """The policy saved in ``checkpoint``; None (with a warning) when it is missing or unreadable."""
    path = Path(checkpoint) / POLICY_FILE
    if not path.is_file():
        logger.info(
            "accelerate_neuron: %s has no %s (saved without the plugin, or with save_only_model): the resumed "
            "run pads batches with this run's length buckets",
            checkpoint,
            POLICY_FILE,
        )
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        fields = _validate({k: record[k] for k in _FIELDS}, str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("accelerate_neuron: ignoring %s (%s): using this run's length buckets", path, exc)
        return None
    name = os.path.basename(os.path.normpath(checkpoint))
    return ShapePolicy(source=f"saved in {name}", **fields)


def adopt(current: ShapePolicy, saved: ShapePolicy | None) -> ShapePolicy | None:
    """The policy a resumed run uses instead of ``current``, or None to keep ``current``."""
    if saved is None or same_shapes(saved, current):
        return None
    if current.explicit:
        logger.warning(
            "accelerate_neuron: resuming with %s (buckets %s), not the checkpoint's buckets %s: the resumed steps "
            "compile new graphs and their losses may differ in the last bits from an uninterrupted run. Unset "
            "%s (or train_buckets in neuron_config) to resume exactly.",
            current.source,
            list(current.buckets),
            list(saved.buckets),
            BUCKETS_ENV,
        )
        return None
    logger.warning(
        "accelerate_neuron: resuming with the length buckets %s (%s), not %s (%s), so batches are padded as in "
        "the interrupted run; set %s to choose other buckets.",
        list(saved.buckets),
        saved.source,
        list(current.buckets),
        current.source,
        BUCKETS_ENV,
    )
    return saved
