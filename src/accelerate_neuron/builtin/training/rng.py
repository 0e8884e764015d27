"""``torch.neuron``'s RNG state in Trainer checkpoints and Accelerate's ``save_state``.

Trainer (4.57 and 5.x) writes the python/numpy/CPU states and those of CUDA,
XLA, NPU, HPU, MLU, MUSA into ``rng_state[_<rank>].pth``, never Neuron's: a
resumed run then redraws the dropout masks it drew before the interruption and
diverges from the uninterrupted run. Accelerate < 1.16 has the same fixed
device list in ``save_accelerator_state`` / ``load_accelerator_state``; 1.16
enumerates any accelerator through ``get_torch_accelerator_backend`` and
already saves ``get_rng_state_all()`` under ``torch_neuron_manual_seed``, so
that patch stands aside there.

The wrappers run upstream's save, then add the Neuron states to the file it
wrote (unless upstream already put them there), and after upstream's load set
them back. Every visible core's state is saved (``get_rng_state_all``): a model
spread over several cores draws on each of them.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from ... import device
from ...files import replacing

logger = logging.getLogger(__name__)

#: Key of the Neuron states in Trainer's ``rng_state.pth`` (upstream names each device by its type).
TRAINER_KEY = "neuron"
#: Key Accelerate 1.16 uses (``f"torch_{device_type}_manual_seed"``); older releases get the same key.
ACCELERATE_KEY = "torch_neuron_manual_seed"


def neuron_states() -> list[Any] | None:
    """Every visible core's RNG state, or None when there is no Neuron runtime to read."""
    module = device.neuron_module()
    if module is None or not device.runtime_initialized():
        # No runtime yet: nothing on the device has drawn a random number, the seed says it all.
        return None
    return [state.clone() for state in module.get_rng_state_all()]


def restore_neuron_states(states: Any, source: str) -> bool:
    """Set the cores' RNG states saved in ``source``; warn (once per call) when they cannot be."""
    module = device.neuron_module()
    if module is None or states is None:
        return False
    if not isinstance(states, list | tuple):  # one core's state (a single tensor)
        states = [states]
    count = module.device_count()
    if len(states) != count:
        logger.warning(
            "accelerate_neuron: %s holds the RNG states of %d Neuron core(s) but %d are visible now; "
            "restoring the first %d. Dropout will not replay exactly as in the interrupted run: resume "
            "with the same NEURON_RT_VISIBLE_CORES to make it exact.",
            source,
            len(states),
            count,
            min(len(states), count),
        )
    for index, state in enumerate(states[:count]):
        module.set_rng_state(state, index)
    return True


def _atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, then rename: never a half-written file."""
    import torch

    with replacing(path) as tmp:
        torch.save(obj, tmp)


# ------------------------------------------------------------------ Trainer


def _trainer_load(path: Path) -> Any:
    import contextlib

    import torch
    import transformers.trainer

    # Upstream loads this file with weights_only=True under its numpy allow-list; so do we.
    allow = getattr(transformers.trainer, "safe_globals", None)
    with allow() if allow is not None else contextlib.nullcontext():
        return torch.load(path, weights_only=True)


def _trainer_rng_file(trainer: Any, checkpoint: str | os.PathLike[str]) -> Path:
    # Upstream's naming: one file per process when the world is larger than one.
    args = trainer.args
    name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    return Path(checkpoint) / name


def wrap_trainer_save_rng_state(original: Any) -> Any:
    @functools.wraps(original)
    def _save_rng_state(self: Any, output_dir: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, output_dir, *args, **kwargs)
        states = neuron_states()
        if states is None:
            return result
        path = _trainer_rng_file(self, output_dir)
        try:
            saved = _trainer_load(path)
        except FileNotFoundError:
            logger.warning("accelerate_neuron: %s was not written; Neuron RNG states not saved", path)
            return result
        if TRAINER_KEY not in saved:  # upstream may learn to save them itself
            saved[TRAINER_KEY] = states
            _atomic_torch_save(saved, path)
        return result

    return _save_rng_state


def wrap_trainer_load_rng_state(original: Any) -> Any:
    @functools.wraps(original)
    def _load_rng_state(self: Any, checkpoint: str | None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, checkpoint, *args, **kwargs)
        if checkpoint is None or device.neuron_module() is None:
            return result
        path = _trainer_rng_file(self, checkpoint)
        if not path.is_file():
            return result  # upstream already logged that reproducibility is not guaranteed
        saved = _trainer_load(path)
        if TRAINER_KEY in saved:
            restore_neuron_states(saved[TRAINER_KEY], str(path))
        else:
            logger.warning(
                "accelerate_neuron: %s has no Neuron RNG state (saved without the plugin?): dropout on Neuron "
                "will not replay exactly as in the interrupted run",
                path,
            )
        return result

    return _load_rng_state


# ------------------------------------------------------------------ Accelerate


def accelerate_needed(original: Any) -> str | None:
    """None when Accelerate's checkpointing lacks Neuron, else why the patch stands aside."""
    if "get_torch_accelerator_backend" in getattr(original, "__globals__", {}):
        return (
            "upstream Accelerate enumerates the accelerator through get_torch_accelerator_backend and saves "
            "torch.neuron.get_rng_state_all() itself"
        )
    return None


def _accelerate_rng_file(directory: str | os.PathLike[str], process_index: int) -> Path:
    from accelerate.utils import RNG_STATE_NAME

    return Path(directory) / f"{RNG_STATE_NAME}_{process_index}.pkl"


def _accelerate_load(path: Path) -> Any:
    from accelerate.utils import load

    # Accelerate's own loader: it allow-lists the numpy RNG state for weights_only loads. Never unpickle
    # anything else: a checkpoint on a shared file system may hold a planted pickle.
    return load(path, weights_only=True)


def wrap_save_accelerator_state(original: Any) -> Any:
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        states = neuron_states()
        if states is None:
            return result
        bound = signature.bind(*args, **kwargs)
        path = _accelerate_rng_file(result or bound.arguments["output_dir"], bound.arguments["process_index"])
        saved = _accelerate_load(path)
        if ACCELERATE_KEY not in saved:
            saved[ACCELERATE_KEY] = states
            _atomic_torch_save(saved, path)
        return result

    return save_accelerator_state


def wrap_load_accelerator_state(original: Any) -> Any:
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if device.neuron_module() is None:
            return result
        bound = signature.bind(*args, **kwargs)
        path = _accelerate_rng_file(bound.arguments["input_dir"], bound.arguments["process_index"])
        try:
            saved = _accelerate_load(path)
        except Exception:
            return result  # upstream logged "Could not load random states"
        if ACCELERATE_KEY in saved:
            restore_neuron_states(saved[ACCELERATE_KEY], str(path))
        return result

    return load_accelerator_state
