"""Run by tests/test_moe.py under ``torchrun``: ``Trainer`` with ``torch_compile=True`` on a tiny MoE model loaded
with expert parallelism, a few steps on fixed batches of one shape (each step another routing).

    torchrun --nproc_per_node=N ep_trainer.py OUT_DIR TP FSDP EP MODEL_DIR

``DistributedConfig(tp_size=TP, fsdp_size=FSDP, ep_size=EP)``; with TP=FSDP=EP=1 and no torchrun it is the
single-process reference on neuron:0 with the global batch (``FSDP / EP * ...``: every rank's rows in one batch),
so its losses are the mean of the ranks' and its weights the ranks' after each step (the router's auxiliary loss
is off: it is not a mean over rows). Each rank writes OUT_DIR/rank<r>.json: the losses logged, a checksum of the
experts' and the other weights after training (the experts gathered over the EP group), and the simulator's
counts of the training (graphs, their kinds and graph-break reasons, host ops, eager signatures).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import _rank_report
import torch
import transformers
from torch.distributed.tensor import DTensor

STEPS = 3
ROWS = 2  # per rank and step
LENGTH = 16


def load(model_dir: str, tp: int, fsdp: int, ep: int) -> Any:
    if tp * fsdp * ep == 1:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir).to("neuron:0")
    config = transformers.DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config)


def rows(batches: int) -> list[dict[str, list[int]]]:
    """``STEPS`` global batches of ``batches * ROWS`` rows; rank r's rows of step s are rows r*ROWS.. of it."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (STEPS * batches * ROWS, LENGTH), generator=generator)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def counts(since: dict[str, Any]) -> dict[str, Any]:
    from accelerate_neuron import simulator

    now = simulator.stats()
    graphs = now["graphs"][len(since["graphs"]) :]
    return {
        "graph_keys": [g["cache_key"] for g in graphs],
        "kinds": [g["kind"] for g in graphs],
        "breaks": sorted({(g.get("frame") or {}).get("graph_break") or "" for g in graphs} - {""}),
        "host_ops": sorted({op for g in graphs for op in g.get("host_ops", [])}),
        "eager_signatures": now["eager_signatures"] - since["eager_signatures"],
        "cpu_fallbacks": now["cpu_fallbacks"] - since["cpu_fallbacks"],
    }


class GraphsPerStep(transformers.TrainerCallback):
    """The simulator's graph count after each step: a step of a new routing must compile nothing new."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from accelerate_neuron import simulator

        self.graphs.append(len(simulator.stats()["graphs"]))


class InOrder(transformers.Trainer):
    """Batches in dataset order (Accelerate hands rank r every r-th batch), so one process can stand for the job."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main() -> None:
    from accelerate_neuron import simulator

    out_dir, tp, fsdp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model = load(sys.argv[5], tp, fsdp, ep)
    distributed = torch.distributed.is_initialized()
    # Distinct batches per step: the launch's data-parallel ranks (fsdp), or as many in the reference's one batch.
    batches = fsdp if distributed else batches_of_reference()
    data = rows(batches)
    per_device = ROWS if distributed else ROWS * batches
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=per_device,
        max_steps=STEPS,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        torch_compile=True,
        dataloader_drop_last=True,
    )
    steps = GraphsPerStep()
    trainer = InOrder(model=model, args=args, train_dataset=data, callbacks=[steps])
    simulator.reset_stats()
    start = simulator.stats()
    trainer.train()
    report: dict[str, Any] = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "train": counts(start),
        "graphs_after_step": steps.graphs,
    }
    experts = [full(p.detach()).float().sum().item() for n, p in model.named_parameters() if ".experts." in n]
    others = [full(p.detach()).float().sum().item() for n, p in model.named_parameters() if ".experts." not in n]
    report["experts_checksum"], report["others_checksum"] = sum(experts), sum(others)
    report["device"] = str(next(model.parameters()).device)
    _rank_report.finish(out_dir, report)


def batches_of_reference() -> int:
    """The reference's global batch: as many rank batches as the launch it stands for (``REFERENCE_BATCHES``)."""
    import os

    return int(os.environ.get("REFERENCE_BATCHES", "1"))


if __name__ == "__main__":
    main()
