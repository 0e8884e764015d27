"""Built-in plugin ``training``: stock training scripts on Neuron, compiling few graphs.

- ``TrainingArguments`` (:mod:`._training_args`): ``neuron:0`` for a single
  process (a launched run keeps the rank's core from Accelerate's state),
  ``bf16=True`` accepted, ``fp16=True`` refused with a pointer to bf16,
  ``torch_compile=True`` -> backend ``"neuron"``, ``dataloader_drop_last``
  on by default with compile.
- compile (:mod:`._training_compile`): ``DynamoBackend.NEURON`` backfilled,
  ``dynamic=False`` for the neuron backend in Accelerate's ``TorchDynamoPlugin``.
- static shapes (:mod:`._training_shapes`): stock collators' batches padded to
  length buckets (``neuron_training_shape_policy``).
- recompile watchdog (:mod:`._training_watchdog`).

Hooks implemented: ``neuron_compile_config`` (purpose ``"train"``),
``neuron_training_shape_policy``. Nothing here imports transformers or
accelerate: patches are applied when those modules are imported.
"""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..patching import Patch
from . import _training_args, _training_compile, _training_shapes, _training_trainer


@hookimpl
def neuron_patches() -> list[Patch]:
    return [*_training_compile.patches(), *_training_args.patches(), *_training_trainer.patches()]


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "train":
        return None
    return dict(_training_compile.DEFAULT_CONFIG)


@hookimpl
def neuron_training_shape_policy(max_length: int | None) -> dict[str, Any] | None:
    return _training_shapes.default_policy(max_length)
