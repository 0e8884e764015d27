"""``Trainer`` on Neuron with torch.compile: bucketed batches and the recompile watchdog.

Two patches, active only when the Trainer compiles on a Neuron device:

- ``Trainer._get_dataloader`` (all of train / eval / test dataloaders): the
  Trainer's plan (its model's maximum length, its tokenizer's pad token, a
  resumed checkpoint's buckets) for the dataloader Accelerate prepares, whose
  batches :mod:`.batches` pads to the length buckets whatever the collator;
  evaluation keeps its last, smaller batch when the plugin (not the user)
  turned ``dataloader_drop_last`` on, so metrics see every sample.
- ``Trainer.__init__``: adds a callback that attaches the recompile watchdog
  to the compiled model once training has prepared it.
- ``Trainer._save_optimizer_and_scheduler`` / ``Trainer._inner_training_loop``:
  the shape policy is saved with each checkpoint and adopted on resume
  (:mod:`.shape_state`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from typing import Any

from ... import device
from ..shapes import record_key
from . import batches, shape_state
from .args import DROP_LAST_ATTR
from .collate import Plan, collator_tokenizer, pad_values_for
from .shapes import ShapePolicy, max_length_of, model_max_length, resolve_policy, tokenizer_max_length
from .watchdog import RecompileWatchdog

logger = logging.getLogger(__name__)

#: Where a resumed Trainer keeps the policy its checkpoint was trained with.
RESUMED_ATTR = "_accelerate_neuron_resumed_policy"


def compiles_on_neuron(args: Any) -> bool:
    """Whether a Trainer with these arguments compiles its model on a Neuron core."""
    try:
        return bool(getattr(args, "torch_compile", False)) and device.is_neuron(args.device)
    except Exception:
        return False


def trainer_policy(trainer: Any) -> ShapePolicy:
    resumed = getattr(trainer, "__dict__", {}).get(RESUMED_ATTR)
    if resumed is not None:
        return resumed
    model = getattr(trainer, "model", None)
    limit = max_length_of(model_max_length(model), tokenizer_max_length(_tokenizer(trainer)))
    return resolve_policy(limit, record_key(model) if model is not None else None)


def _tokenizer(trainer: Any) -> Any:
    return collator_tokenizer(getattr(trainer, "data_collator", None)) or getattr(trainer, "processing_class", None)


def _plan(trainer: Any) -> Plan:
    policy = trainer_policy(trainer)
    collator = trainer.data_collator
    tokenizer = _tokenizer(trainer)
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    record = record_key(model) if model is not None else None
    return Plan(policy, pad_values_for(collator, policy, tokenizer=tokenizer, config=config), record)


def wrap_get_dataloader(original: Any) -> Any:
    signature = inspect.signature(original)

    def _get_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not device.is_neuron(getattr(self.args, "device", None)):
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            is_training = bool(bound.arguments.get("is_training", False))
            plan = _plan(self)
        except ValueError:
            raise  # a bad policy setting: the message names it
        except Exception:
            logger.warning("accelerate_neuron: batches keep the collator's shapes (shape policy failed)", exc_info=True)
            return original(self, *args, **kwargs)
        keep_eval_tail = not is_training and self.args.dataloader_drop_last and self.args.__dict__.get(DROP_LAST_ATTR)
        if keep_eval_tail:
            self.args.dataloader_drop_last = False
        try:
            # Accelerator.prepare_data_loader (.batches) pads the batches with this Trainer's plan.
            with batches.trainer_plan(plan):
                return original(self, *args, **kwargs)
        finally:
            if keep_eval_tail:
                self.args.dataloader_drop_last = True

    return _get_dataloader


def _watchdog_callback(trainer: Any, watchdog: RecompileWatchdog) -> Any:
    from transformers import TrainerCallback

    ref = weakref.ref(trainer)

    class NeuronRecompileWatchdog(TrainerCallback):
        """Attaches :class:`RecompileWatchdog` to the model the Trainer actually calls."""

        def __init__(self) -> None:
            self.watchdog = watchdog

        def _attach(self) -> None:
            owner = ref()
            model = getattr(owner, "model_wrapped", None) if owner is not None else None
            if model is not None:
                self.watchdog.attach(model)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._attach()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._attach()

    return NeuronRecompileWatchdog()


def wrap_trainer_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            if compiles_on_neuron(self.args):
                ref = weakref.ref(self)

                def expected(name: str, old: Any, new: Any) -> bool:
                    # A new length bucket is a compile the policy intends (a resumed run's is the checkpoint's).
                    owner = ref()
                    return (
                        owner is not None
                        and old is not None
                        and new is not None
                        and len(old) == len(new) >= 2
                        and old[0] == new[0]
                        and old[2:] == new[2:]
                        and trainer_policy(owner).is_target(new[1])
                    )

                self.add_callback(_watchdog_callback(self, RecompileWatchdog(expected=expected)))
        except ValueError:
            raise  # bad user configuration (e.g. ACCELERATE_NEURON_RECOMPILE_WARMUP)
        except Exception:
            logger.debug("accelerate_neuron: recompile watchdog not installed", exc_info=True)

    return __init__


def wrap_save_optimizer_and_scheduler(original: Any) -> Any:
    @functools.wraps(original)
    def _save_optimizer_and_scheduler(self: Any, output_dir: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, output_dir, *args, **kwargs)
        if compiles_on_neuron(self.args) and self.args.should_save:
            shape_state.save(trainer_policy(self), output_dir)
        return result

    return _save_optimizer_and_scheduler


def wrap_inner_training_loop(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _inner_training_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop(RESUMED_ATTR, None)
        checkpoint = signature.bind(self, *args, **kwargs).arguments.get("resume_from_checkpoint")
        if isinstance(checkpoint, str | os.PathLike) and compiles_on_neuron(self.args):
            chosen = shape_state.adopt(trainer_policy(self), shape_state.load(checkpoint))
            if chosen is not None:
                self.__dict__[RESUMED_ATTR] = chosen
        return original(self, *args, **kwargs)

    return _inner_training_loop
