"""Static training shapes whatever builds the batch: plain Accelerate loops, TRL's SFTTrainer, PEFT LoRA.

Every dataloader Accelerate prepares on Neuron pads its batches to the length
buckets (``builtin/training/batches.py``). Counts come from the simulator's
compile records (forward and backward graphs handed to the ``"neuron"``
backend); the simulator computes on the CPU, so losses are compared with a CPU
run of the same script, unpadded (the simulator does not model Neuron numerics:
docs/fidelity.md).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accelerate_neuron import simulator, tiny

# Each batch of 4 has another longest sample: 4 lengths, unbucketed, are 4 shapes (8 graphs with backward).
LENGTHS = [5, 12, 9, 3, 60, 18, 33, 41, 30, 7, 25, 14, 50, 47, 8, 21]
BATCH = 4
BUCKETS = "32,64"


def pad_to_longest(features: list[list[int]]) -> dict[str, torch.Tensor]:
    """A user's collator: pads to the longest sample, on the right, with token 0 (and passes position_ids)."""
    longest = max(len(f) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f)] = torch.tensor(f)
        mask[row, : len(f)] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # explicit position_ids, 0 on the pad
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def _samples(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@pytest.fixture
def fresh_accelerator() -> Iterator[None]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _loop(cpu: bool) -> tuple[list[float], list[tuple[int, ...]], dict[str, Any]]:
    """A plain Accelerate training loop, as a user writes it: the same on the CPU and on Neuron."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    torch._dynamo.reset()
    simulator.reset_stats()
    accelerator = Accelerator(cpu=cpu)
    model = tiny.model("llama").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_samples(LENGTHS), batch_size=BATCH, collate_fn=pad_to_longest)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if not cpu:
        model = torch.compile(model, backend="neuron", dynamic=False)
    losses, shapes = [], []
    for batch in loader:
        shapes.append(tuple(batch["input_ids"].shape))
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, shapes, simulator.stats()


def test_plain_accelerate_loop_with_a_custom_collator(
    fresh_accelerator: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", BUCKETS)
    cpu_losses, cpu_shapes, _ = _loop(cpu=True)
    with caplog.at_level(logging.INFO, logger="accelerate_neuron"):
        losses, shapes, stats = _loop(cpu=False)
    # Upstream's shapes: one per batch (4 lengths); here: the two buckets.
    assert [s[1] for s in cpu_shapes] == [12, 60, 30, 50]
    assert shapes == [(BATCH, 32), (BATCH, 64), (BATCH, 32), (BATCH, 64)]
    graphs = [g for g in stats["graphs"] if g["kind"] in ("forward", "backward")]
    assert 0 < len(graphs) <= 2 * 2  # length buckets touched x (forward + backward)
    assert stats["compiles"] <= 2 * 2
    # Padding is masked (attention 0) and ignored by the loss (-100): every step's loss is the CPU's.
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    announced = [r.getMessage() for r in caplog.records if "padded on the right" in r.getMessage()]
    assert len(announced) == 1 and "pad_to_longest" in announced[0] and "[32, 64]" in announced[0]


def test_unknown_sequence_keys_leave_the_batch_alone_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    from accelerate_neuron import hookimpl, plugins
    from accelerate_neuron.builtin.training.collate import BucketingCollator, Plan, pad_values_for
    from accelerate_neuron.builtin.training.shapes import ShapePolicy, resolve_policy

    def with_weights(features: list[list[int]]) -> dict[str, torch.Tensor]:
        batch = pad_to_longest(features)
        batch["token_weights"] = batch["attention_mask"].float()
        return batch

    policy = ShapePolicy(buckets=(16,))
    collate = BucketingCollator(with_weights, Plan(policy, pad_values_for(with_weights, policy)))
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        first = collate(_samples([3, 5]))
        collate(_samples([4, 6]))
    assert first["input_ids"].shape == (2, 5) and first["token_weights"].shape == (2, 5)  # as the collator made it
    warnings = [r.getMessage() for r in caplog.records if "no known pad value" in r.getMessage()]
    assert len(warnings) == 1 and "token_weights" in warnings[0]

    # A plugin declares the pad value: the key is padded with the others.
    class Weights:
        @hookimpl
        def neuron_training_shape_policy(self, max_length: int | None) -> dict[str, Any]:
            return {"buckets": [16], "pad_values": {"token_weights": 0.0}}

    with plugins.registered(Weights(), name="weights"):
        policy = resolve_policy(None)
    collate = BucketingCollator(with_weights, Plan(policy, pad_values_for(with_weights, policy)))
    batch = collate(_samples([3, 5]))
    assert batch["token_weights"].shape == (2, 16) and batch["token_weights"][:, 5:].eq(0).all()
    # A dataloader worker gets a pickled copy: a plan still to resolve is resolved first, in the main process.
    import pickle

    resolved = []
    lazy = BucketingCollator(pad_to_longest, resolve=lambda: Plan(policy, pad_values_for(pad_to_longest, policy)))
    lazy.__dict__["_on_first"] = resolved.append
    copy = pickle.loads(pickle.dumps(lazy))
    assert copy(_samples([3, 5]))["input_ids"].shape == (2, 16) and len(resolved) == 1
    # decoder_* keys pad as their unprefixed names; float (batch, classes) labels are not a sequence.
    values = pad_values_for(pad_to_longest, policy)
    assert values["decoder_attention_mask"] == 0 and values["decoder_input_ids"] == 0
    multi = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.zeros(2, 3)}
    out = BucketingCollator(lambda f: dict(multi), Plan(policy, values))([])
    assert out["input_ids"].shape == (2, 16) and out["labels"].shape == (2, 3)


# ---------------------------------------------------------------- TRL SFTTrainer + PEFT LoRA

_WORDS = "the cat sat on a mat and then ran off to see the dog who was very happy".split()


def _prompt_completion_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Prompt/completion pairs (TRL's completion-only loss) of long-tailed lengths."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words))

    return [
        {"prompt": text(rng.randint(1, 4)), "completion": text(max(1, round(rng.lognormvariate(1.6, 0.9))))}
        for _ in range(n)
    ]


class _Recorder:
    """Wraps TRL's collator to record the length it padded each batch to (upstream's shape)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator
        self.lengths: list[int] = []

    def __call__(self, features: list[Any]) -> Any:
        batch = self.collator(features)
        self.lengths.append(int(batch["input_ids"].shape[1]))
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


def _sft_trainer(tmp_path: Any, *, cpu: bool = False, steps: int = 6, peft: bool = True, **config: Any) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        use_cpu=cpu,
        torch_compile=not cpu,
        **{"pad_to_multiple_of": None, "max_length": 128, **config},  # TRL's "auto" pads to multiples of 128 on Neuron
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return SFTTrainer(
        model=tiny.model("llama"),
        args=args,
        train_dataset=Dataset.from_list(_prompt_completion_rows(BATCH * steps, seed=3)),
        processing_class=tiny.tokenizer(),
        peft_config=lora if peft else None,
    )


def _sft(tmp_path: Any, **kwargs: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    simulator.reset_stats()
    trainer = _sft_trainer(tmp_path, **kwargs)
    recorder = _Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    loss = trainer.train().training_loss
    return {"loss": loss, "trainer": trainer, "upstream_lengths": recorder.lengths, **simulator.stats()}


def test_trl_sft_with_lora_completion_only_is_bucketed_and_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel

    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", BUCKETS)
    cpu = _sft(tmp_path, cpu=True)  # upstream's shapes, unpadded (the simulator computes on the CPU too)
    run = _sft(tmp_path)
    trainer = run["trainer"]
    assert trainer.args.device.type == "neuron" and trainer.args.completion_only_loss is not False
    # Upstream's shapes: a length per batch, each a new graph on Neuron; the plugin's: the buckets they fall in.
    upstream = sorted(set(run["upstream_lengths"]))
    touched = sorted({32 if n <= 32 else 64 for n in upstream})
    assert cpu["upstream_lengths"] == run["upstream_lengths"] and len(upstream) >= 4 and touched == [32, 64], upstream
    # TRL's step breaks into several graphs, compiled once per bucket: the same number for each.
    assert run["compiles"] > 0 and run["compiles"] % len(touched) == 0
    # Completion-only loss, LoRA, padded: every real token counts as in the unpadded run, the pad never does.
    assert run["loss"] == pytest.approx(cpu["loss"], rel=1e-5)

    # PEFT: the adapter saved from the device reloads bit-identical, and merges on Neuron.
    model = trainer.model
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny.model("llama"), tmp_path / "adapter")
    trained = {k: v.detach().cpu() for k, v in model.state_dict().items() if "lora_" in k}
    again = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert trained and trained.keys() == again.keys()
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in trained.items() if "lora_B" in k)  # it trained
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]], device=model.device)
    with torch.no_grad():
        # model.base_model: the LoRA model without the bf16 autocast Accelerate wrapped around model.forward.
        before = model.base_model(input_ids=ids).logits.cpu()
        merged = model.merge_and_unload()
        after = merged(input_ids=ids).logits.cpu()
    assert next(merged.parameters()).device.type == "neuron" and not isinstance(merged, PeftModel)
    assert next(merged.parameters()).dtype == torch.float32
    assert torch.allclose(before, after, atol=1e-5, rtol=1e-5)  # W + B @ A once, instead of x @ W + (x @ A) @ B


@pytest.mark.parametrize(
    "config", [{"packing": True}, {"padding_free": True, "max_length": None}], ids=["packing", "padding_free"]
)
def test_trl_packed_and_padding_free_batches_keep_their_shapes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]
) -> None:
    """Flattened batches (one row, boundaries in position_ids) pass as TRL built them: no new shape, no broken
    sequence boundaries (their cu_seq_lens would no longer match a longer row)."""
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", BUCKETS)
    trainer = _sft_trainer(tmp_path, peft=False, **{"pad_to_multiple_of": "auto", **config})
    recorder = _Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    batches = list(trainer.get_train_dataloader())
    assert batches and all("cu_seq_lens_q" in b and b["input_ids"].shape[0] == 1 for b in batches)
    assert [b["input_ids"].shape[1] for b in batches] == recorder.lengths  # TRL's own shapes, untouched
    assert all(b["position_ids"].shape == b["input_ids"].shape == b["labels"].shape for b in batches)


def _dpo_trainer(tmp_path: Any, *, cpu: bool = False) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": s["completion"]}
        for r, s in zip(_prompt_completion_rows(8, seed=4), _prompt_completion_rows(8, seed=5), strict=True)
    ]
    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"),
        per_device_train_batch_size=BATCH,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        max_length=128,
        pad_to_multiple_of=None,
        use_cpu=cpu,
        torch_compile=not cpu,
        # TRL turns bf16 on by default; the CPU's autocast casts other ops than an accelerator's (the simulator
        # takes CUDA's lists, as TorchNeuron's autocast does), and DPO's loss, a difference of two sums of
        # log-probabilities, shows that at rel 1e-4. In float32 the device run equals the CPU's.
        bf16=False,
    )
    return DPOTrainer(
        model=tiny.model("llama"),
        ref_model=tiny.model("llama"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny.tokenizer(),
    )


def test_trl_dpo_batches_are_bucketed_and_the_loss_is_exact(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """DPO stacks chosen and rejected rows, right-padded, with a completion mask: all known keys, padded exactly,
    and the preference loss is the unpadded run's on the CPU."""
    cpu = _dpo_trainer(tmp_path, cpu=True).train().training_loss
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "32,64,128")
    torch._dynamo.reset()
    trainer = _dpo_trainer(tmp_path)
    recorder = _Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    batches = list(trainer.get_train_dataloader())
    assert {k for b in batches for k in b} >= {"input_ids", "attention_mask", "completion_mask"}
    assert [b["input_ids"].shape for b in batches] == [
        (2 * BATCH, next(b for b in (32, 64, 128) if b >= n)) for n in recorder.lengths
    ]
    for b in batches:
        assert b["attention_mask"].shape == b["completion_mask"].shape == b["input_ids"].shape
        real = b["attention_mask"].sum(dim=1)
        assert all(b["completion_mask"][row, int(n) :].eq(0).all() for row, n in enumerate(real))
    # Padded chosen/rejected log-probabilities sum over the completion mask only: the loss is the unpadded one's.
    assert trainer.train().training_loss == pytest.approx(cpu, rel=1e-5)
