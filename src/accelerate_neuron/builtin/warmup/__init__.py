"""Built-in plugin ``warmup``: the warm-up mode behind ``accelerate-neuron precompile`` and ``precompile()``.

A warm-up runs the user's script unchanged but, instead of generating or
training for real, compiles every graph the bucket policies make reachable for
what the script does, so the real run finds them all in the NEFF cache:

- ``generate()`` (:mod:`.generation`): one compiled prefill and one decode step
  per distinct (prompt bucket, batch bucket, cache bucket), a stand-in result of
  the real call's length;
- bucketed inference calls (:mod:`.forward`): each distinct (model, length
  bucket, batch bucket, arguments) compiled by one worker, stand-in outputs
  elsewhere;
- ``generate_batch()`` (:mod:`.batching`): continuous batching's warm-up over
  every (query-token bucket, KV bucket) step shape, stand-in results;
  ``init_continuous_batching().warmup()`` (what ``transformers serve`` runs)
  warms the same claimed shapes;
- ``Trainer`` (:mod:`.training`): the Trainer's own steps over one batch per
  distinct length bucket (forward and backward), then the weights restored;
  ``evaluate()`` / ``predict()`` likewise; nothing written to the output folder.

Which worker warms which shape is :mod:`..precompile_session`'s business (a shared
module: continuous batching's own warm-up claims its shapes through it too). The patches are
offered only in a process that ``ACCELERATE_NEURON_PRECOMPILE`` marks as a
warm-up worker; :func:`apply_patches` applies them on demand for the Python API.
Everywhere else this plugin changes nothing.
"""

from __future__ import annotations

from ...hookspecs import hookimpl
from ...patching import Patch, apply
from .. import precompile_session as session
from ..upstream_features import without_step_padding
from . import batching, forward, generation, training

GEN = "transformers.generation.utils"
_MIXIN = "GenerationMixin"
_TRAINER = "transformers.trainer"


def generation_patches() -> list[Patch]:
    return [
        Patch(
            GEN,
            f"{_MIXIN}.generate",
            generation.wrap_generate,
            reason="precompile: generate() warms each distinct shape once and returns a stand-in of the real length",
            lacking="every release (a warm-up mode is this plugin's own)",
            params=("inputs",),
            name="warmup.generate",
        ),
        *(
            Patch(
                GEN,
                f"{_MIXIN}.{loop}",
                generation.wrap_decode_loop,
                reason="precompile: the decode loop of a new shape stops after one decode step; others leave at once",
                lacking="every release",
                params=("input_ids", "stopping_criteria", "generation_config"),
                name=f"warmup.{loop}",
            )
            for loop in ("_sample", "_beam_search")
        ),
        Patch(
            "transformers.generation.continuous_batching.continuous_api",
            "ContinuousMixin.generate_batch",
            batching.wrap_generate_batch,
            reason="precompile: generate_batch() runs continuous batching's warm-up over every step shape (each "
            "claimed, so --jobs splits them) and returns stand-in results",
            lacking="every release (a warm-up mode is this plugin's own)",
            params=("inputs", "generation_config", "continuous_batching_config"),
            needed=without_step_padding,
            name="warmup.generate_batch",
        ),
    ]


def forward_patches() -> list[Patch]:
    return [
        Patch(
            "accelerate_neuron.builtin.inference.call",
            "ForwardCall.run",
            forward.wrap_run,
            reason="precompile: a bucketed inference call compiles its shape once across the workers; the other "
            "workers get a stand-in output of the real structure and shape",
            lacking="this package's inference plugin (a warm-up mode is this plugin's own)",
            name="warmup.forward",
        )
    ]


def training_patches() -> list[Patch]:
    dataloaders = [
        Patch(
            _TRAINER,
            f"Trainer.{method}",
            training.wrap_dataloader(kind),
            reason=f"precompile: the {kind} dataloader yields one batch per distinct shape",
            lacking="every release",
            name=f"warmup.{method}",
        )
        for method, kind in (
            ("get_train_dataloader", "train"),
            ("get_eval_dataloader", "eval"),
            ("get_test_dataloader", "predict"),
        )
    ]
    writes = [
        Patch(
            _TRAINER,
            f"Trainer.{method}",
            training.skip_writes(method),
            reason="precompile: a warm-up writes no model, checkpoint or metrics and pushes nothing",
            lacking="every release",
            name=f"warmup.{method}",
        )
        for method in (
            "save_model",
            "_save_checkpoint",
            "save_state",
            "save_metrics",
            "push_to_hub",
            "create_model_card",
        )
    ]
    return [
        Patch(
            _TRAINER,
            "Trainer.__init__",
            training.wrap_init,
            reason="precompile: the Trainer works in a scratch folder and reports to no tracker",
            lacking="every release",
            params=("model", "args"),
            name="warmup.Trainer.__init__",
        ),
        *dataloaders,
        Patch(
            _TRAINER,
            "Trainer.train",
            training.wrap_train,
            reason="precompile: one epoch over the representative batches, then the weights restored",
            lacking="every release",
            name="warmup.Trainer.train",
        ),
        *writes,
    ]


@hookimpl
def neuron_patches() -> list[Patch]:
    if not session.requested():
        return []
    return [*generation_patches(), *forward_patches(), *training_patches()]


def apply_patches(*, training_too: bool = False) -> None:
    """Apply the warm-up patches now (the Python API; a worker process gets them through ``neuron_patches``)."""
    for patch in [*generation_patches(), *forward_patches(), *(training_patches() if training_too else [])]:
        apply(patch, plugin="warmup")
