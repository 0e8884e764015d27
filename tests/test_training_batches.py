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
    """A user's collator: pads to the longest sample, on the right, with token 0."""
    longest = max(len(f) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f)] = torch.tensor(f)
        mask[row, : len(f)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


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
    # decoder_* keys pad as their unprefixed names; float (batch, classes) labels are not a sequence.
    values = pad_values_for(pad_to_longest, policy)
    assert values["decoder_attention_mask"] == 0 and values["decoder_input_ids"] == 0
    multi = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.zeros(2, 3)}
    out = BucketingCollator(lambda f: dict(multi), Plan(policy, values))([])
    assert out["input_ids"].shape == (2, 16) and out["labels"].shape == (2, 3)
