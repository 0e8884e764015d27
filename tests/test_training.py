"""Training on Neuron: TrainingArguments, Trainer with bucketed shapes, recompile watchdog.

The Trainer runs use a tiny Llama on the simulated device. Counts come from
the simulator's compile records (graphs handed to the ``"neuron"`` backend);
the simulator does not model compile time or Neuron numerics (results are CPU
results), so losses are compared with the CPU run's, and compile figures are
counts, never timings.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from accelerate_neuron import simulator, tiny
from accelerate_neuron.simulator import neff_cache

# Distinct lengths: each batch's longest sample differs, so upstream compiles one graph per batch.
LENGTHS = [5, 60, 12, 44, 23, 9, 37, 51, 16, 30, 57, 7, 40, 19, 26, 48]
BATCH = 4
BUCKETS = "32,64"


def _args(tmp_path: Any, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", logging_strategy="no", seed=0)
    return TrainingArguments(**{**base, **kwargs})


# ---------------------------------------------------------------- TrainingArguments


def test_training_arguments_on_neuron(tmp_path: Any, unpatched: Any) -> None:
    from accelerate.utils.dataclasses import DynamoBackend, TorchDynamoPlugin
    from transformers import Seq2SeqTrainingArguments

    args = _args(tmp_path, bf16=True, torch_compile=True)
    assert args.device == torch.device("neuron", 0)
    assert args.n_gpu == 1
    assert args.bf16 and args.torch_compile_backend == "neuron"
    assert args.dataloader_drop_last is True
    assert args.distributed_state.device.type == "neuron"  # the Trainer's Accelerator shares this state
    # Accelerate's plugin for the neuron backend compiles with static shapes.
    assert DynamoBackend("NEURON").value == "NEURON"
    assert TorchDynamoPlugin(backend="neuron").to_kwargs() == {"backend": "neuron", "dynamic": False}

    # Explicit choices win, also through a subclass and when equal to the default.
    kept = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        torch_compile=True,
        torch_compile_backend="eager",
        dataloader_drop_last=False,
    )
    assert kept.torch_compile_backend == "eager" and kept.dataloader_drop_last is False
    assert TorchDynamoPlugin(backend="neuron", dynamic=True).dynamic is True
    eager = _args(tmp_path)
    assert eager.device.type == "neuron" and eager.dataloader_drop_last is False  # no compile: nothing to pin
    cpu = _args(tmp_path, use_cpu=True, torch_compile=True)
    assert cpu.device.type == "cpu" and cpu.dataloader_drop_last is False and cpu.torch_compile_backend == "inductor"

    with unpatched():
        stock = _args(tmp_path, torch_compile=True)
        assert stock.dataloader_drop_last is False
        stock_device = stock.device.type
        try:
            _args(tmp_path, bf16=True)
            stock_bf16 = True
        except ValueError as exc:
            assert "bf16" in str(exc)
            stock_bf16 = False
    # Transformers 5 already picks neuron:0 and accepts bf16; 4.57 does neither.
    assert stock_device == ("neuron" if stock_bf16 else "cpu")


BF16_POINTER = (
    r"fp16 training is not supported on Neuron. Train in bf16.*TrainingArguments\(bf16=True\).*mixed_precision"
)


def test_fp16_is_refused_with_a_pointer_to_bf16(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"^fp16=True: " + BF16_POINTER):
        _args(tmp_path, fp16=True)
    assert _args(tmp_path, fp16=True, use_cpu=True).fp16  # the CPU keeps upstream's behaviour


def test_fp16_from_an_accelerator_or_a_launch_config_is_refused_with_a_pointer_to_bf16(
    monkeypatch: pytest.MonkeyPatch, unpatched: Any
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def build(**kwargs: Any) -> tuple[str, str, bool]:
        """(device type, mixed precision, has a grad scaler) of ``Accelerator(**kwargs)``."""
        AcceleratorState._reset_state(True)
        try:
            accelerator = Accelerator(**kwargs)
            return accelerator.device.type, accelerator.mixed_precision, accelerator.scaler is not None
        finally:
            AcceleratorState._reset_state(True)

    with pytest.raises(ValueError, match=r"^Accelerator\(mixed_precision='fp16'\): " + BF16_POINTER):
        build(mixed_precision="fp16")
    # What `accelerate launch` hands each process for `mixed_precision: fp16` in its config file.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match=r"^ACCELERATE_MIXED_PRECISION=fp16 \(`accelerate launch` sets it from"):
        build()
    assert build(mixed_precision="bf16")[:2] == ("neuron", "bf16")  # the argument beats the variable, as upstream
    assert build(cpu=True)[:2] == ("cpu", "fp16")  # the CPU keeps upstream's behaviour
    with unpatched():  # 1.16: fp16 with a GradScaler for the neuron device; 1.10 knows no neuron: the CPU
        assert build() in (("neuron", "fp16", True), ("cpu", "fp16", False))


def test_argument_parser_gets_the_neuron_defaults(tmp_path: Any) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--torch_compile", "--report_to", "none"]
    )
    assert args.torch_compile_backend == "neuron" and args.dataloader_drop_last is True


def test_a_launched_run_keeps_accelerates_device() -> None:
    from types import SimpleNamespace

    from accelerate_neuron.builtin.training.args import _neuron_device

    cpu = torch.device("cpu")
    launched = SimpleNamespace(
        use_cpu=False, distributed_state=SimpleNamespace(distributed_type="MULTI_CPU", device=cpu)
    )
    assert _neuron_device(launched, cpu) is cpu
    single = SimpleNamespace(use_cpu=False, distributed_state=SimpleNamespace(distributed_type="NO", device=cpu))
    assert _neuron_device(single, cpu) == torch.device("neuron", 0)
    assert single.distributed_state.device == torch.device("neuron", 0)


# ---------------------------------------------------------------- shape policy


def test_seq2seq_batches_are_padded_to_buckets_without_changing_content() -> None:
    from transformers import DataCollatorForSeq2Seq

    from accelerate_neuron.builtin.training.collate import bucketing_collator
    from accelerate_neuron.builtin.training.shapes import ShapePolicy

    tok = tiny.tokenizer()
    stock = DataCollatorForSeq2Seq(tok)
    features = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(10, 10 + m))} for n, m in ((5, 3), (9, 11))]
    plain = stock([dict(f) for f in features])
    padded = bucketing_collator(stock, ShapePolicy(buckets=(8, 16)))([dict(f) for f in features])
    assert padded["input_ids"].shape == (2, 16) and padded["attention_mask"].shape == (2, 16)
    assert padded["labels"].shape == (2, 16)
    assert torch.equal(padded["input_ids"][:, :9], plain["input_ids"])
    assert torch.equal(padded["labels"][:, :11], plain["labels"])
    assert (padded["input_ids"][:, 9:] == tok.pad_token_id).all()
    assert (padded["attention_mask"][:, 9:] == 0).all() and (padded["labels"][:, 11:] == -100).all()


def test_static_collators_are_left_alone_and_custom_ones_are_bucketed() -> None:
    from transformers import DataCollatorWithPadding, default_data_collator

    from accelerate_neuron.builtin.training.collate import bucketing_collator
    from accelerate_neuron.builtin.training.shapes import ShapePolicy

    tok = tiny.tokenizer()
    policy = ShapePolicy(buckets=(8, 16))
    assert bucketing_collator(DataCollatorWithPadding(tok, padding="max_length", max_length=12), policy) is None
    assert bucketing_collator(DataCollatorWithPadding(tok, padding=False), policy) is None
    assert bucketing_collator(DataCollatorWithPadding(tok), ShapePolicy(buckets=())) is None
    assert bucketing_collator(DataCollatorWithPadding(tok), policy) is not None
    # Any other collator (a function, TRL's) is bucketed: whatever built the batch, its known keys are padded.
    custom = bucketing_collator(default_data_collator, policy)
    assert custom is not None
    batch = custom([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9, 10], "labels": [8, 9, 10]}])
    assert batch["input_ids"].shape == (2, 8) and batch["labels"][:, 3:].eq(-100).all()


def test_bucket_arithmetic() -> None:
    from accelerate_neuron.builtin.training.shapes import ShapePolicy

    policy = ShapePolicy(buckets=(64, 128), pad_to_multiple_of=100)
    assert [policy.target_length(n) for n in (1, 64, 65, 128, 129, 250)] == [64, 64, 128, 128, 200, 300]
    assert policy.target_length(50, multiple=48) == 96  # the collator's own pad_to_multiple_of still holds
    assert policy.is_target(128) and policy.is_target(300) and not policy.is_target(100)
    assert ShapePolicy(buckets=(64,)).target_length(70) == 70  # beyond the buckets, without a multiple: as is


def test_policy_from_env_and_from_a_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_neuron import hookimpl, plugins
    from accelerate_neuron.builtin.training.shapes import resolve_policy

    assert resolve_policy(512).buckets == (64, 128, 256, 512)
    assert resolve_policy(300).buckets == (64, 128, 256, 300)

    class ShortBuckets:
        @hookimpl
        def neuron_training_shape_policy(self, max_length: int | None) -> dict[str, Any]:
            return {"buckets": [max_length // 4, max_length], "pad_values": {"pixel_mask": 0}}

    with plugins.registered(ShortBuckets(), name="short-buckets"):
        policy = resolve_policy(512)
        assert policy.buckets == (128, 512) and policy.pad_values == {"pixel_mask": 0} and policy.drop_last
        monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "32, 96")
        assert resolve_policy(512).buckets == (32, 96)  # the user's environment wins over plugins
        monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "off")
        assert not resolve_policy(512).active
        monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128,big")
        with pytest.raises(ValueError, match="ACCELERATE_NEURON_TRAIN_BUCKETS='128,big'"):
            resolve_policy(512)


# ---------------------------------------------------------------- watchdog


def test_watchdog_names_the_input_and_warns_once(sim: Any, caplog: pytest.LogCaptureFixture) -> None:
    from accelerate_neuron.builtin.training.watchdog import RecompileWatchdog

    torch._dynamo.reset()
    layer = torch.nn.Linear(4, 4).to("neuron")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.layer(x).sum() + y.sum()

    model = torch.compile(Net(), backend="neuron", dynamic=False)
    dog = RecompileWatchdog(warmup=1)
    assert dog.attach(model) and not dog.attach(model)

    def call(xs: tuple[int, ...], ys: tuple[int, ...]) -> None:
        model(torch.ones(*xs, device="neuron"), y=torch.ones(*ys, device="neuron"))

    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        call((2, 3, 4), (2, 3))  # warm-up compile
        call((2, 3, 4), (2, 3))  # cached
        call((2, 5, 4), (2, 3))  # new length of x
        call((2, 7, 4), (2, 3))  # x again: already reported
        call((2, 7, 4), (1, 3))  # batch size of y
    warnings = [r.getMessage() for r in caplog.records if "compiled a new graph" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "shape changed: 'x' (2, 3, 4) -> (2, 5, 4)" in warnings[0] and "pad sequences" in warnings[0]
    assert "shape changed: 'y' (2, 3) -> (1, 3)" in warnings[1] and "dataloader_drop_last=True" in warnings[1]
    # What each new shape cost, as the backend's own compile metrics (torch.neuron.get_dynamo_metrics()) report it.
    assert [e["backend_graphs"] for e in dog.events] == [1, 1]
    assert all("the backend compiled 1 graph(s) of" in w for w in warnings)
    assert len(torch.neuron.get_dynamo_metrics()) == 4  # the warm-up, x's two new lengths, y's new batch
    # The simulator's own compile records agree on the shapes the warnings name.
    xs = [
        tuple(i["shape"])
        for g in simulator.stats()["graphs"]
        if g["kind"] == "forward"
        for i in g["dynamo_inputs"]
        if i["name"] in ("L['x']", "L['args'][0]")
    ]
    assert xs == [(2, 3, 4), (2, 5, 4), (2, 7, 4), (2, 7, 4)]


def test_watchdog_warmup_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_neuron.builtin.training.watchdog import WARMUP_ENV, RecompileWatchdog

    monkeypatch.setenv(WARMUP_ENV, "3")
    assert RecompileWatchdog().warmup == 3
    monkeypatch.setenv(WARMUP_ENV, "soon")
    with pytest.raises(ValueError, match="ACCELERATE_NEURON_RECOMPILE_WARMUP='soon'"):
        RecompileWatchdog()


# ---------------------------------------------------------------- Trainer runs


def _features(lengths: list[int]) -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    return [{"input_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in lengths]


def _train(tmp_path: Any, **kwargs: Any) -> tuple[float, Any, dict[str, Any]]:
    from transformers import DataCollatorForLanguageModeling, Trainer

    torch._dynamo.reset()
    simulator.reset_stats()
    args = _args(tmp_path, per_device_train_batch_size=BATCH, num_train_epochs=1, **kwargs)
    trainer = Trainer(
        model=tiny.model("llama"),
        args=args,
        train_dataset=_features(LENGTHS),
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
    )
    # Each run is compared with the others as a first run: a cold NEFF cache of its own.
    with neff_cache.temporary():
        loss = trainer.train().training_loss
        # Read now: the next TrainingArguments resets Accelerate's shared state.
        return loss, trainer, {**simulator.stats(), "mixed_precision": trainer.accelerator.mixed_precision}


def _seq_lengths(stats: dict[str, Any]) -> list[int]:
    """Sequence length of ``input_ids`` of each Dynamo graph the neuron backend compiled."""
    seen: dict[int, int] = {}
    for g in stats["graphs"]:
        for i in g["dynamo_inputs"]:
            if "input_ids" in i["name"]:
                seen[g["dynamo_graph"]] = int(i["shape"][1])
    return [seen[k] for k in sorted(seen)]


def test_dataloaders_are_bucketed_and_evaluation_keeps_every_sample(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import DataCollatorForLanguageModeling, Trainer

    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", BUCKETS)
    args = _args(tmp_path, torch_compile=True, per_device_train_batch_size=4, per_device_eval_batch_size=4)
    features = _features(LENGTHS[:6])
    collator = DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False)
    trainer = Trainer(
        model=tiny.model("llama"), args=args, train_dataset=features, eval_dataset=features, data_collator=collator
    )
    train = list(trainer.get_train_dataloader())
    evaluation = list(trainer.get_eval_dataloader())
    assert [b["input_ids"].shape[0] for b in train] == [4]  # drop_last on by default
    assert [b["input_ids"].shape[0] for b in evaluation] == [4, 2]  # metrics see every sample
    assert [b["input_ids"].shape[1] for b in evaluation] == [64, 32]
    assert {b["labels"].shape[1] for b in train} <= {32, 64}
    assert args.dataloader_drop_last is True and trainer.data_collator is collator


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The CPU run, the plugin's run and the baselines on the same data (shared: each run compiles)."""
    from accelerate_neuron import logs
    from accelerate_neuron.builtin.training.shapes import BUCKETS_ENV

    tmp = tmp_path_factory.mktemp("runs")
    mp = pytest.MonkeyPatch()
    results: dict[str, Any] = {}
    handler = _Collect()
    logging.getLogger("accelerate_neuron").addHandler(handler)
    try:
        results["cpu"] = _train(tmp, use_cpu=True)
        mp.setenv(BUCKETS_ENV, BUCKETS)
        logs.forget("training.buckets")  # announced once per process: earlier tests may have seen it
        results["plugin"] = _train(tmp, torch_compile=True)
        results["plugin_logs"] = handler.take()
        mp.setenv(BUCKETS_ENV, "off")
        # Upstream's shapes on the device, under the watchdog; bf16 here covers autocast on Neuron.
        results["buckets_off"] = _train(tmp, torch_compile=True, bf16=True)
        results["buckets_off_logs"] = handler.take()
        mp.delenv(BUCKETS_ENV)
        from conftest import unpatched_upstream

        with unpatched_upstream():
            stock_args = _args(tmp, torch_compile=True)
            results["stock_device"] = stock_args.device.type
            if results["stock_device"] == "neuron":
                results["stock"] = _train(tmp, torch_compile=True)
    finally:
        logging.getLogger("accelerate_neuron").removeHandler(handler)
        mp.undo()
        for key in [k for k in os.environ if k.startswith(("ACCELERATE_DYNAMO_", "ACCELERATE_MIXED"))]:
            del os.environ[key]
    yield results


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    def take(self) -> list[str]:
        out, self.records = self.records, []
        return out


def test_trainer_loss_matches_the_cpu_run(runs: dict[str, Any]) -> None:
    cpu_loss, _, _ = runs["cpu"]
    loss, trainer, stats = runs["plugin"]
    assert math.isfinite(loss)
    assert loss == pytest.approx(cpu_loss, rel=1e-4)
    assert trainer.args.device.type == "neuron" and next(trainer.model.parameters()).device.type == "neuron"
    assert trainer.state.global_step == len(LENGTHS) // BATCH
    # Every compiled step saw a bucket length, and the collator was restored after the dataloader was built.
    assert set(_seq_lengths(stats)) <= {32, 64} and stats["compiles"] > 0
    assert type(trainer.data_collator).__name__ == "DataCollatorForLanguageModeling"
    announced = [m for m in runs["plugin_logs"] if "padded on the right to the length buckets [32, 64]" in m]
    assert len(announced) == 1 and "ACCELERATE_NEURON_TRAIN_BUCKETS=off" in announced[0]
    assert not [m for m in runs["plugin_logs"] if "compiled a new graph" in m]  # buckets are expected compiles


def test_compiled_graphs_are_at_most_half_of_upstreams(runs: dict[str, Any]) -> None:
    _, _, ours = runs["plugin"]
    # Upstream's baseline: stock Transformers/Accelerate when they reach the Neuron device (5.x);
    # 4.57 trains on the CPU (no graph reaches Neuron), so the baseline is the plugin with buckets off,
    # i.e. upstream's collator shapes on the Neuron device.
    if runs["stock_device"] == "neuron":
        _, _, baseline = runs["stock"]
        assert baseline["compiles"] == runs["buckets_off"][2]["compiles"]
    else:
        assert runs["stock_device"] == "cpu"
        _, _, baseline = runs["buckets_off"]
    assert len(set(_seq_lengths(baseline))) == len(LENGTHS) // BATCH  # one graph per batch length upstream
    assert 0 < ours["compiles"] <= baseline["compiles"] / 2


def test_trainer_watchdog_warns_about_unbucketed_lengths(runs: dict[str, Any]) -> None:
    loss, _, stats = runs["buckets_off"]
    assert math.isfinite(loss) and loss == pytest.approx(runs["cpu"][0], rel=5e-2)
    assert stats["mixed_precision"] == "bf16"
    dtypes = {i["dtype"] for g in stats["graphs"] if g["kind"] == "backward" for i in g["inputs"] if "dtype" in i}
    assert "bfloat16" in dtypes  # activations saved for backward were computed in bf16 on the device
    warnings = [m for m in runs["buckets_off_logs"] if "compiled a new graph after warm-up" in m]
    assert len(warnings) == 1, warnings  # once per input, although every step recompiled
    first, second = _seq_lengths(stats)[:2]
    assert f"'input_ids' ({BATCH}, {first}) -> ({BATCH}, {second})" in warnings[0]
    assert "'labels'" in warnings[0] and "ACCELERATE_NEURON_TRAIN_BUCKETS" in warnings[0]
