"""Exact resume on Neuron: a Trainer checkpoint and an Accelerator ``save_state`` bring back every RNG state.

Trainer (4.57 and 5.x) and Accelerate < 1.16 save the CPU, CUDA, XLA, NPU, ... RNG states, never Neuron's;
the plugin adds every core's ``torch.neuron`` state (``builtin/training/rng.py``). The model has dropout
on the device, so a resume that does not restore the core's generator redraws the masks of the first
steps: weights and losses then differ from the uninterrupted run (checked, with the patch taken out).
The Trainer runs as a Trainium job would: bf16, ``torch_compile`` (backend ``"neuron"``), the plugin's
length buckets; results are compared bitwise (the simulator is deterministic on the CPU). A 2-rank
``accelerate launch`` job is killed and relaunched the same way (``scripts/launch_resume.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_neuron import tiny

STEPS, SAVE_AT = 4, 2


def _features() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 30, 17, 25, 12, 28, 21, 14, 31, 10, 19, 27, 8, 23, 16, 29]
    return [{"input_ids": torch.randint(3, 300, (n,), generator=gen).tolist()} for n in lengths]


def _dropout_model() -> Any:
    return tiny.model("gpt2", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0)


def _trainer(out: Path) -> Any:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    torch._dynamo.reset()
    args = TrainingArguments(
        output_dir=str(out),
        report_to=[],
        seed=0,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        bf16=True,
        torch_compile=True,  # backend "neuron" (the plugin's default for it), static shapes from its buckets
    )
    return Trainer(
        model=_dropout_model(),
        args=args,
        train_dataset=_features(),
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
    )


def _result(trainer: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = {k: v.detach().float().cpu().clone() for k, v in trainer.model.state_dict().items()}
    return losses, weights


def _killed_run(out: Path, moment: str, **env: str) -> None:
    """``scripts/train_killed_in_save.py``: the same job in a child process, SIGKILLed at ``moment``."""
    import subprocess
    import sys

    from helpers import REPO, clean_env

    script = Path(__file__).parent / "scripts" / "train_killed_in_save.py"
    child_env = clean_env(ACCELERATE_NEURON_SIMULATE="1", PYTHONPATH=str(Path(__file__).parent), **env)
    proc = subprocess.run(
        [sys.executable, str(script), str(out), moment],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )
    assert proc.returncode == -9, proc.stderr[-4000:]  # SIGKILL, not a clean exit


def _resumed(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.neuron.manual_seed(1234)  # whatever the killed process's generator held is gone
    resumed = _trainer(out)
    resumed.train(resume_from_checkpoint=True)
    return _result(resumed)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_resume_after_sigkill_replays_dropout_exactly(
    sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from transformers import Trainer

    uninterrupted = _trainer(tmp_path / "whole")
    uninterrupted.train()
    want_losses, want_weights = _result(uninterrupted)
    assert str(next(uninterrupted.model.parameters()).device).startswith("neuron")
    assert len(want_losses) == STEPS

    checkpoint = tmp_path / "whole" / f"checkpoint-{SAVE_AT}"
    saved = torch.load(checkpoint / "rng_state.pth", weights_only=False)
    assert len(saved["neuron"]) == torch.neuron.device_count()  # every visible core's generator
    # Rewritten with the Neuron states, the file keeps the permissions upstream's files get (0644 under umask
    # 022), so a service account that resumes a shared checkpoint can read it.
    assert (checkpoint / "rng_state.pth").stat().st_mode == (checkpoint / "scheduler.pt").stat().st_mode

    _killed_run(tmp_path / "killed", "after-save")  # SIGKILL right after checkpoint-2 is on disk
    assert sorted(p.name for p in (tmp_path / "killed").glob("checkpoint-*")) == [f"checkpoint-{SAVE_AT}"]
    shutil.copytree(tmp_path / "killed", tmp_path / "unpatched")

    losses, weights = _resumed(tmp_path / "killed")
    assert losses == want_losses
    assert _same(weights, want_weights)

    # The same resume without the plugin's restore redraws the first steps' dropout masks.
    monkeypatch.setattr(Trainer, "_load_rng_state", Trainer._load_rng_state.__wrapped__)
    losses, weights = _resumed(tmp_path / "unpatched")
    assert losses[:SAVE_AT] == want_losses[:SAVE_AT]
    assert losses[SAVE_AT:] != want_losses[SAVE_AT:]
    assert not _same(weights, want_weights)


def _accelerate_steps(acc: Any, model: Any, opt: Any, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids.to(acc.device), labels=ids.to(acc.device)).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_accelerator_save_state_and_load_state_replay_dropout_exactly(sim: Any, tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 300, (2, 16), generator=gen) for _ in range(4)]

    def fresh() -> tuple[Any, Any, Any]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator()
        torch.manual_seed(0)
        model = _dropout_model().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    acc, model, opt = fresh()
    assert acc.device.type == "neuron"
    want = _accelerate_steps(acc, model, opt, batches)

    acc, model, opt = fresh()
    first = _accelerate_steps(acc, model, opt, batches[:2])
    acc.save_state(str(tmp_path / "state"))
    torch.neuron.manual_seed(1234)  # the interrupted process's generator is gone
    acc, model, opt = fresh()
    acc.load_state(str(tmp_path / "state"))
    rest = _accelerate_steps(acc, model, opt, batches[2:])
    assert first + rest == want


def test_rng_patches_are_applied_or_stand_aside_for_upstream(unpatched: Any) -> None:
    import accelerate.checkpointing
    import transformers.trainer

    from accelerate_neuron import patching
    from accelerate_neuron.builtin.training import rng

    records = {r.target: r for r in patching.records() if r.plugin == "training" and "rng" in r.target.lower()}
    records.update(
        {r.target: r for r in patching.records() if r.plugin == "training" and "accelerator_state" in r.target}
    )
    assert len(records) == 4, sorted(records)
    save_state = accelerate.checkpointing.save_accelerator_state
    lacks = rng.accelerate_needed(getattr(save_state, "__wrapped__", save_state)) is None
    for target, rec in records.items():
        if "accelerator_state" in target and not lacks:
            assert rec.status == "skipped" and rec.detail.startswith("upstream"), (target, rec.detail)
        else:
            assert rec.status == "applied", (target, rec.status, rec.detail)
    saved = transformers.trainer.Trainer._save_rng_state
    with unpatched():
        assert transformers.trainer.Trainer._save_rng_state is saved.__wrapped__
    assert transformers.trainer.Trainer._save_rng_state.__wrapped__ is saved.__wrapped__  # re-applied after


def test_resume_after_a_kill_inside_the_checkpoint_write_picks_the_last_complete_one(
    sim: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    _killed_run(out, "in-save")  # inside checkpoint-4's write
    assert (out / "checkpoint-4" / "model.safetensors").is_file()  # weights written, state torn
    with caplog.at_level("WARNING", logger="accelerate_neuron"):
        assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert any("checkpoint-4 (trainer_state.json unreadable" in r.getMessage() for r in caplog.records)

    resumed = _trainer(out)
    resumed.train(resume_from_checkpoint=True)  # upstream's name bound in transformers.trainer is patched too
    losses, weights = _result(resumed)
    whole = _trainer(tmp_path / "whole")
    whole.train()
    want_losses, want_weights = _result(whole)
    assert losses == want_losses and _same(weights, want_weights)


def _recording_lengths(trainer: Any) -> list[int]:
    lengths: list[int] = []
    step = trainer.training_step

    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        lengths.append(inputs["input_ids"].shape[1])
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    return lengths


def test_resume_pads_with_the_checkpoints_length_buckets(
    sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import shutil

    from accelerate_neuron.builtin.training.shape_state import POLICY_FILE
    from accelerate_neuron.builtin.training.shapes import BUCKETS_ENV

    monkeypatch.setenv(BUCKETS_ENV, "32,48")  # the interrupted job's choice; the default would pad to 64
    whole = _trainer(tmp_path / "whole")
    seen = _recording_lengths(whole)
    whole.train()
    want_losses, want_weights = _result(whole)
    assert set(seen) == {32}

    _killed_run(tmp_path / "killed", "after-save", **{BUCKETS_ENV: "32,48"})
    record = json.loads((tmp_path / "killed" / f"checkpoint-{SAVE_AT}" / POLICY_FILE).read_text())
    assert record["buckets"] == [32, 48] and record["source"] == f"{BUCKETS_ENV}=32,48"
    shutil.copytree(tmp_path / "killed", tmp_path / "explicit")

    monkeypatch.delenv(BUCKETS_ENV)  # the restarted job forgot it: the checkpoint remembers
    resumed = _trainer(tmp_path / "killed")
    seen = _recording_lengths(resumed)
    with caplog.at_level("WARNING", logger="accelerate_neuron"):
        resumed.train(resume_from_checkpoint=True)
    assert seen == [32] * (STEPS - SAVE_AT)
    losses, weights = _result(resumed)
    assert losses == want_losses and _same(weights, want_weights)
    assert any(
        f"resuming with the length buckets [32, 48] (saved in checkpoint-{SAVE_AT})" in r.getMessage()
        for r in caplog.records
    )
    saved = json.loads((tmp_path / "killed" / f"checkpoint-{STEPS}" / POLICY_FILE).read_text())
    assert saved["buckets"] == [32, 48]  # and the next checkpoint keeps it

    # A bucket choice named in this run's environment wins, with a warning that the resume is not exact.
    caplog.clear()
    monkeypatch.setenv(BUCKETS_ENV, "64")
    explicit = _trainer(tmp_path / "explicit")
    seen = _recording_lengths(explicit)
    with caplog.at_level("WARNING", logger="accelerate_neuron"):
        explicit.train(resume_from_checkpoint=True)
    assert seen == [64] * (STEPS - SAVE_AT)
    assert any("not the checkpoint's buckets [32, 48]" in r.getMessage() for r in caplog.records)


def test_an_unreadable_saved_policy_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from accelerate_neuron.builtin.training import shape_state
    from accelerate_neuron.builtin.training.shapes import ShapePolicy

    policy = ShapePolicy(buckets=(64, 128), pad_to_multiple_of=None, source="built-in default")
    assert shape_state.load(shape_state.save(policy, tmp_path).parent) == ShapePolicy(
        buckets=(64, 128), source="saved in " + tmp_path.name
    )
    (tmp_path / shape_state.POLICY_FILE).write_text('{"buckets": [64, -1], "pad_to_multiple_of": null}')
    with caplog.at_level("WARNING", logger="accelerate_neuron"):
        assert shape_state.load(tmp_path) is None
    assert any(shape_state.POLICY_FILE in r.getMessage() and "ignoring" in r.getMessage() for r in caplog.records)
    assert shape_state.adopt(policy, None) is None


@pytest.mark.slow
def test_two_rank_accelerate_launch_killed_and_resumed_equals_the_uninterrupted_job(tmp_path: Path) -> None:
    """``scripts/launch_resume.py`` under ``accelerate launch`` on 2 cores: save_state after step 3, every rank
    SIGKILLed at step 4, relaunched with load_state + skip_first_batches: the job ends where the uninterrupted
    one does, bitwise. Accelerate loads the model ``on_device`` with several processes, as ``"neuron:0"``,
    which safetensors refused (``placement.accelerate_load_state_model``)."""
    import json

    from accelerate.commands.config import default

    from helpers import run_launcher

    config_file = tmp_path / "default_config.yaml"
    default.write_basic_config(save_location=str(config_file))  # MULTI_NEURON, 2 processes, dynamo NEURON
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config_file)]
    script = str(Path(__file__).parent / "scripts" / "launch_resume.py")

    def job(out: Path, mode: str) -> None:
        run_launcher([*launch, "--main_process_port", "0", script, str(out), mode], cores=2)

    def reports(out: Path, mode: str) -> list[dict]:
        return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]

    job(tmp_path / "full", "full")
    killed = run_launcher(
        [*launch, "--main_process_port", "0", script, str(tmp_path / "run"), "killed"],
        cores=2,
        timeout=600,
        check=False,
    )
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-4000:]
    job(tmp_path / "run", "resumed")

    full, before, after = (
        reports(tmp_path / d, m) for d, m in (("full", "full"), ("run", "killed"), ("run", "resumed"))
    )
    for rank in (0, 1):
        assert full[rank]["device"] == after[rank]["device"] == "neuron:0"
        assert before[rank]["losses"] + after[rank]["losses"] == full[rank]["losses"]
        assert after[rank]["weights"] == full[rank]["weights"]


def test_accelerate_load_state_skips_the_automatic_checkpoint_a_kill_left_half_written(
    sim: Any, unpatched: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``scripts/accelerate_killed_in_save.py``: SIGKILL inside the second automatic ``save_state``, half of
    ``random_states_0.pkl`` on disk. Upstream's ``load_state()`` takes that checkpoint_1 and, as it cannot
    read the RNG file, goes on without it (an info-level log line): a silently inexact resume. The plugin's
    takes checkpoint_0 and says why."""
    import subprocess

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration
    from safetensors.torch import load_file

    from helpers import REPO, clean_env

    script = Path(__file__).parent / "scripts" / "accelerate_killed_in_save.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=clean_env(ACCELERATE_NEURON_SIMULATE="1"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )
    assert proc.returncode == -9, proc.stderr[-4000:]
    folders = tmp_path / "checkpoints"
    saved = [load_file(folders / name / "model.safetensors") for name in ("checkpoint_0", "checkpoint_1")]
    assert any(not torch.equal(saved[0][k], saved[1][k]) for k in saved[0])  # two different states on disk

    def loaded() -> dict[str, torch.Tensor]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        acc = Accelerator(project_config=project)
        model = _dropout_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        acc.load_state()
        # unwrap: a dynamo backend left in the environment by another test compiles it (keys "_orig_mod.")
        return {k: v.detach().cpu() for k, v in acc.unwrap_model(model).state_dict().items()}

    def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(got[k], want[k]) for k in want)

    with caplog.at_level("WARNING", logger="accelerate_neuron"):
        assert equal(loaded(), saved[0])
    assert any("checkpoint_1 (random_states_0.pkl unreadable" in r.getMessage() for r in caplog.records)
    with unpatched():
        assert equal(loaded(), saved[1])  # upstream: the torn checkpoint, no error


class _Planted:
    """What an attacker leaves in a shared checkpoint: a pickle whose loading writes ``marker`` (runs code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_pickle_planted_in_a_checkpoint_never_runs(sim: Any, tmp_path: Path) -> None:
    """The completeness check of ``load_state()`` reads zip archives, never unpickles: a planted
    ``random_states_0.pkl`` reaches only Accelerate's own ``weights_only=True`` load, which refuses it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from accelerate_neuron.builtin.training import checkpoints

    def accelerator() -> Any:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        acc = Accelerator(project_config=project)
        model = acc.prepare(torch.nn.Linear(4, 4))
        return acc, model

    acc, _ = accelerator()
    acc.save_state()
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    marker = tmp_path / "planted-code-ran"
    torch.save(_Planted(marker), folder / "random_states_0.pkl")

    acc, _ = accelerator()
    acc.load_state()  # upstream refuses the planted file (weights_only) and goes on, as it does for a torn one
    assert not marker.exists(), "loading the checkpoint ran the planted pickle"

    torch.save(_Planted(marker), folder / "custom_checkpoint_0.pkl")
    assert checkpoints.accelerate_incomplete(str(folder), processes=1, custom_objects=1) is None  # whole archives
    assert not marker.exists(), "the completeness check ran the planted pickle"
    half = folder / "custom_checkpoint_0.pkl"
    half.write_bytes(half.read_bytes()[:-40])
    assert "custom_checkpoint_0.pkl unreadable" in checkpoints.accelerate_incomplete(str(folder), 1, 1)

    torch.load(folder / "random_states_0.pkl", weights_only=False)  # the planted file is live: unpickled, it runs
    assert marker.read_text() == "ran"
