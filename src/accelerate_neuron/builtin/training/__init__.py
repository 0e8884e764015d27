"""Built-in plugin ``training``: stock training scripts on Neuron, compiling few graphs.

- ``TrainingArguments`` (:mod:`.args`): ``neuron:0`` for a single
  process (a launched run keeps the rank's core from Accelerate's state),
  ``bf16=True`` accepted, ``fp16=True`` refused with a pointer to bf16
  (also ``Accelerator(mixed_precision="fp16")`` and a launch config's fp16:
  :mod:`.precision`),
  ``torch_compile=True`` -> backend ``"neuron"``, ``dataloader_drop_last``
  on by default with compile.
- compile settings (:mod:`.compile_config`): ``DynamoBackend.NEURON`` backfilled
  (:mod:`..enum_backfill`), ``dynamic=False`` for the neuron backend in
  Accelerate's ``TorchDynamoPlugin``.
- static shapes (:mod:`.shapes` the policy, :mod:`.collate` the wrapped
  collate_fn): every dataloader Accelerate prepares on Neuron (the Trainer's,
  TRL's, a plain loop's) pads its batches to length buckets whatever collator
  built them (:mod:`.batches`); the Trainer supplies its plan (:mod:`.trainer`).
- recompile watchdog (:mod:`.watchdog`).
- exact resume (:mod:`.rng`): ``torch.neuron``'s RNG states saved and restored
  by Trainer checkpoints and by Accelerate's ``save_state`` / ``load_state``.
- the length buckets saved with each checkpoint and adopted on resume
  (:mod:`.shape_state`, wired by :mod:`.trainer`).
- crash-safe resume (:mod:`.checkpoints`): ``get_last_checkpoint`` and
  ``Accelerator.load_state()`` (automatic checkpoint naming) skip checkpoint
  folders a killed job left half-written.

Hooks implemented: ``neuron_compile_config`` (purpose ``"train"``),
``neuron_training_shape_policy``. Nothing here imports transformers or
accelerate: patches are applied when those modules are imported.
"""

from __future__ import annotations

from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch
from ..enum_backfill import dynamo_backend_neuron
from . import args, batches, checkpoints, compile_config, precision, rng, shapes, trainer

_ARGS = "transformers.training_args"


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        # --- torch.compile settings
        *dynamo_backend_neuron(),
        Patch(
            "accelerate.utils.dataclasses",
            "TorchDynamoPlugin.__post_init__",
            compile_config.wrap_dynamo_post_init,
            reason="the neuron compile backend needs static shapes: an unset `dynamic` becomes False "
            "(neuron_compile_config('train'))",
            lacking="every release (only the 5.x Trainer passes dynamic=False)",
            params=("self",),
            needed=compile_config.dynamo_needed,
        ),
        # --- TrainingArguments
        *(
            Patch(
                module,
                f"{cls}.__init__",
                args.wrap_init,
                reason="records which fields the user passed, so the Neuron defaults never override an explicit choice",
                lacking="every release",
            )
            for module, cls in (
                (_ARGS, "TrainingArguments"),
                (f"{_ARGS}_seq2seq", "Seq2SeqTrainingArguments"),
            )
        ),
        Patch(
            _ARGS,
            "TrainingArguments.__post_init__",
            args.wrap_post_init,
            reason="on Neuron: fp16 refused with a pointer to bf16, torch_compile_backend defaults to "
            "neuron_compile_config('train'), dataloader_drop_last defaults to True with torch_compile, gradient "
            "checkpointing under torch_compile is non-reentrant unless use_reentrant is set",
            lacking="every release (4.x: the backend defaults to inductor)",
            params=("self",),
        ),
        Patch(
            _ARGS,
            "TrainingArguments._setup_devices",
            args.wrap_setup_devices,
            reason="a single process trains on neuron:0 (4.x falls back to the CPU without CUDA)",
            lacking="transformers 4.x",
            needed=args.setup_devices_needed,
        ),
        Patch(
            "transformers.utils.import_utils",
            "is_torch_bf16_gpu_available",
            args.wrap_bf16_gate,
            reason="bf16=True is accepted on Neuron (4.x raises 'Your setup doesn't support bf16/gpu')",
            lacking="transformers 4.x",
            aliases=(
                "transformers.training_args.is_torch_bf16_gpu_available",
                "transformers.utils.is_torch_bf16_gpu_available",
            ),
            needed=args.bf16_needed,
        ),
        Patch(
            "accelerate.accelerator",
            "Accelerator.__init__",
            precision.wrap_accelerator_init,
            reason="fp16 mixed precision on Neuron (argument, or an Accelerate config's mixed_precision: fp16 handed "
            "over by accelerate launch) stops with a message naming bf16",
            lacking="accelerate <= 1.15 (a message without bf16); 1.16 (fp16 with a GradScaler no public Neuron "
            "document covers)",
            params=("mixed_precision", "cpu"),
        ),
        # --- static batch shapes: every prepared dataloader (Trainer, TRL, plain loops)
        Patch(
            "accelerate.accelerator",
            "Accelerator.prepare_data_loader",
            batches.wrap_prepare_data_loader,
            reason="on Neuron, the batches of every dataloader Accelerate prepares (Trainer's, TRL's, a plain "
            "loop's) are right-padded to a few length buckets whatever collator built them (train_buckets), so "
            "training compiles a few graphs, not one per length",
            lacking="every release",
            params=("self", "data_loader"),
        ),
        # --- Trainer: its plan for those batches, recompile watchdog
        Patch(
            "transformers.trainer",
            "Trainer._get_dataloader",
            trainer.wrap_get_dataloader,
            reason="on Neuron, the Trainer's dataloaders are padded with its model's maximum length, its tokenizer's "
            "pad token and a resumed checkpoint's buckets; evaluation keeps its last batch when the plugin turned "
            "dataloader_drop_last on",
            lacking="every release",
            params=("dataset", "description", "batch_size", "is_training"),
        ),
        Patch(
            "transformers.trainer",
            "Trainer.__init__",
            trainer.wrap_trainer_init,
            reason="a recompile after warm-up names the input whose shape changed and the fix",
            lacking="every release",
            params=("model", "args"),
        ),
        # --- exact resume: the length buckets travel with the checkpoint
        Patch(
            "transformers.trainer",
            "Trainer._save_optimizer_and_scheduler",
            trainer.wrap_save_optimizer_and_scheduler,
            reason="on Neuron with torch_compile, each checkpoint records the length buckets its batches were "
            "padded to (neuron_shape_policy.json, before trainer_state.json)",
            lacking="every release",
            params=("self", "output_dir"),
        ),
        Patch(
            "transformers.trainer",
            "Trainer._inner_training_loop",
            trainer.wrap_inner_training_loop,
            reason="resume_from_checkpoint pads batches with the checkpoint's length buckets (unless "
            "ACCELERATE_NEURON_TRAIN_BUCKETS is set), so the resumed steps compile no new graphs",
            lacking="every release",
            params=("self", "batch_size", "args", "resume_from_checkpoint"),
        ),
        # --- crash-safe resume: never a half-written checkpoint
        Patch(
            "transformers.trainer_utils",
            "get_last_checkpoint",
            checkpoints.wrap_get_last_checkpoint,
            reason="resume_from_checkpoint=True skips checkpoint folders a killed job left without "
            "trainer_state.json (written last), with a warning naming them",
            lacking="every release up to 5.25 (the highest checkpoint-N, finished or not)",
            params=("folder",),
            aliases=("transformers.trainer.get_last_checkpoint",),
            needed=checkpoints.skips_partial,
        ),
        Patch(
            "accelerate.accelerator",
            "Accelerator.load_state",
            checkpoints.wrap_accelerator_load_state,
            reason="load_state() with automatic checkpoint naming skips checkpoint_N folders a killed job left "
            "half-written (a missing or torn random_states_<rank>.pkl), with a warning naming them",
            lacking="every release up to 1.16 (the highest checkpoint_N, finished or not)",
            params=("self", "input_dir"),
        ),
        # --- exact resume: torch.neuron's RNG states in checkpoints
        Patch(
            "transformers.trainer",
            "Trainer._save_rng_state",
            rng.wrap_trainer_save_rng_state,
            reason="checkpoints keep every Neuron core's RNG state (rng_state.pth key 'neuron'), so dropout "
            "replays exactly after resume_from_checkpoint",
            lacking="every release (CUDA/XLA/NPU/HPU/MLU/MUSA only)",
            params=("self", "output_dir"),
        ),
        Patch(
            "transformers.trainer",
            "Trainer._load_rng_state",
            rng.wrap_trainer_load_rng_state,
            reason="resume_from_checkpoint restores the Neuron cores' RNG states saved with the checkpoint",
            lacking="every release",
            params=("self", "checkpoint"),
        ),
        Patch(
            "accelerate.checkpointing",
            "save_accelerator_state",
            rng.wrap_save_accelerator_state,
            reason="Accelerator.save_state keeps every Neuron core's RNG state (key torch_neuron_manual_seed)",
            lacking="accelerate < 1.16 (a fixed device list without Neuron)",
            params=("output_dir", "process_index"),
            aliases=("accelerate.accelerator.save_accelerator_state",),
            needed=rng.accelerate_needed,
        ),
        Patch(
            "accelerate.checkpointing",
            "load_accelerator_state",
            rng.wrap_load_accelerator_state,
            reason="Accelerator.load_state restores the Neuron cores' RNG states",
            lacking="accelerate < 1.16",
            params=("input_dir", "process_index"),
            aliases=("accelerate.accelerator.load_accelerator_state",),
            needed=rng.accelerate_needed,
        ),
    ]


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "train":
        return None
    return dict(compile_config.DEFAULT_CONFIG)


@hookimpl
def neuron_training_shape_policy(max_length: int | None) -> dict[str, Any] | None:
    return shapes.default_policy(max_length)
