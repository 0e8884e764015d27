"""``Trainer`` in a warm-up: the Trainer's own steps on one batch per distinct shape, nothing written, weights kept.

The train / eval / test dataloaders are iterated once, as the real run would
(the training plugin's length buckets included, batches moved to the device as
Accelerate moves them), and only the first batch of each distinct shape in this
worker's shard is kept. ``train()`` then runs upstream's own loop over those
batches, for one epoch: the compiled forward and backward graphs, and the
optimizer's eager ops, are the real run's. The weights are restored afterwards
and the gradients dropped, so a script that goes on (evaluate, generate) sees
the model it built. ``evaluate()`` / ``predict()`` run over their
representatives the same way.

Nothing reaches the user's output folder: the Trainer works in a scratch
folder, reporting integrations (TensorBoard, W&B, ...) are removed, and
``save_model`` / checkpoints / ``push_to_hub`` do nothing.

Under a launcher every rank does this with its own shard of the data, and the
ranks take as many steps as the rank with the most distinct shapes (a training
step all-reduces gradients across ranks, an evaluation step gathers).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import precompile_session as session
from ..model_tag import model_tag

logger = logging.getLogger(__name__)

_KEPT = "_accelerate_neuron_warm_batches"
_USER_OUTPUT = "_accelerate_neuron_user_output_dir"
#: Graphs one training shape compiles at most: the forward and the backward.
GRAPHS = {"train": 2, "eval": 1, "predict": 1}


def _active() -> session.Session | None:
    return session.current()


def _scratch() -> str:
    warm = _active()
    base = warm.scratch if warm is not None and warm.scratch else None
    return tempfile.mkdtemp(prefix="trainer-", dir=base)


def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """The Trainer works in a scratch folder and reports to no tracker during a warm-up."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _active() is None:
            return original(self, *args, **kwargs)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and _USER_OUTPUT not in training_args.__dict__:
            user = training_args.output_dir
            scratch = _scratch()
            training_args.__dict__[_USER_OUTPUT] = user
            training_args.output_dir = scratch
            logging_dir = getattr(training_args, "logging_dir", None)
            if isinstance(logging_dir, str) and user and logging_dir.startswith(str(user)):
                training_args.logging_dir = os.path.join(scratch, "runs")
            logger.info("accelerate_neuron: precompile: the Trainer writes to %s, not %s", scratch, user)
        original(self, *args, **kwargs)
        for callback in list(self.callback_handler.callbacks):
            if type(callback).__module__.startswith("transformers.integrations"):
                self.remove_callback(callback)

    return __init__


class Representatives:
    """The kept batches, in order; everything else (``dataset``, ``set_epoch``, ...) is the real dataloader's."""

    def __init__(self, loader: Any, batches: list[tuple[dict[str, Any], Any]], kind: str) -> None:
        self.loader = loader
        self.batches = batches
        self.kind = kind

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        warm = _active()
        for shape, batch in self.batches:
            started = time.perf_counter()
            try:
                with session.labelled(self.kind, shape):
                    yield batch
            finally:  # also when the loop stops asking after its last step (the Trainer counts its steps)
                if warm is not None:
                    warm.done(self.kind, shape, time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "batches", "kind"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def batch_shape(model: Any, batch: Any) -> dict[str, Any]:
    """Shapes and dtypes of a batch's tensors: what the compiled step's graphs depend on."""
    import torch

    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch if isinstance(batch, list | tuple) else [])
    tensors = {
        str(k): [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in items if isinstance(v, torch.Tensor)
    }
    return {"model": model_tag(model), "batch": tensors}


def _representatives(trainer: Any, loader: Any, kind: str, key: Any) -> Representatives:
    kept: dict[Any, list] = trainer.__dict__.setdefault(_KEPT, {})
    if key not in kept:
        warm = _active()
        batches, first = [], None
        for batch in loader:
            shape = batch_shape(trainer.model, batch)
            if first is None:
                first = (shape, batch)
            if warm is not None and warm.claim(kind, shape, GRAPHS[kind]):
                batches.append((shape, batch))
        if not batches and first is not None and kind != "train":
            # evaluate() over nothing has no metrics to return: run another worker's first shape again
            # (a NEFF cache hit, or one compile shared through the cache lock).
            batches.append(first)
        kept[key] = _in_step_with_the_other_ranks(trainer, batches, first, kind)
        logger.info("accelerate_neuron: precompile: %s runs %d batch shape(s) in this worker", kind, len(batches))
    return Representatives(loader, kept[key], kind)


def _in_step_with_the_other_ranks(trainer: Any, batches: list, first: Any, kind: str) -> list:
    """Under a launcher, every rank runs as many warm-up steps as the rank with the most.

    Each rank meets its own shard of the data, so its own shapes: in a real run the ranks take the same number
    of steps, but one step per distinct shape differs from rank to rank, and a training step all-reduces the
    gradients (an evaluation step gathers) with every other rank. A rank with fewer repeats its last batch (its
    graphs are compiled already), one with none the first batch it met (a NEFF cache hit, or one compile
    shared with the other ranks through the cache lock).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return batches
    accelerator = trainer.accelerator
    counts = accelerator.gather(torch.tensor([len(batches)], device=accelerator.device))
    most = int(counts.max().item())
    spare = batches[-1] if batches else first
    if spare is None and most:
        logger.warning("accelerate_neuron: precompile: this rank has no %s batch while others have some", kind)
        return batches
    return batches + [spare] * (most - len(batches))


def wrap_dataloader(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def get_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
            loader = original(self, *args, **kwargs)
            if _active() is None:
                return loader
            dataset = args[0] if args else next(iter(kwargs.values()), None)
            key = (kind, id(dataset) if dataset is not None and not isinstance(dataset, str) else dataset)
            return _representatives(self, loader, kind, key)

        return get_dataloader

    return wrap


def wrap_train(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _active() is None:
            return original(self, *args, **kwargs)
        import torch
        from transformers.trainer_utils import TrainOutput

        loader = self.get_train_dataloader()
        if len(loader) == 0:
            logger.info("accelerate_neuron: precompile: no training shape for this worker")
            return TrainOutput(0, 0.0, {})
        model = self.model
        saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        args_ = self.args
        kept = (args_.max_steps, args_.num_train_epochs)
        args_.max_steps, args_.num_train_epochs = -1, 1  # one pass over the representatives, whatever the schedule
        try:
            return original(self, *args, **kwargs)
        finally:
            args_.max_steps, args_.num_train_epochs = kept
            with torch.no_grad():
                model.load_state_dict(saved)
            for param in model.parameters():
                param.grad = None

    return train


def skip_writes(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def skipped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _active() is None:
                return original(self, *args, **kwargs)
            logger.info("accelerate_neuron: precompile: Trainer.%s skipped (warm-up writes nothing)", name)
            return None

        return skipped

    return wrap
