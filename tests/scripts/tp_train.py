"""Run by tests/test_graph_breaks.py under ``torchrun``: a stock ``Trainer`` with ``torch_compile`` on a tiny causal
LM loaded with ``DistributedConfig(tp_size=TP, fsdp_size=FSDP)``, 3 steps of one shape.

    torchrun --nproc_per_node=N tp_train.py MODEL_DIR OUT_DIR TP FSDP [upstream]

Each rank writes OUT_DIR/rank<r>.json: its loss, graphs per step, NEFFs and the graph breaks Dynamo met. With
``upstream``, the same training runs again in the same processes with upstream's FSDP2
(``ACCELERATE_NEURON_FSDP_IMPLEMENTATION=fully_shard``), reported under ``"upstream"``: the reference the traced
FSDP's loss is compared with, and the breaks FSDP2's hooks make.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import _rank_report
import torch
import transformers

from accelerate_neuron import simulator


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = [(i * 7 + j) % 300 + 3 for j in range(32)]
        return {"input_ids": ids, "attention_mask": [1] * 32, "labels": ids}


def train(model_dir: str, out_dir: str, tp: int, fsdp: int) -> dict[str, Any]:
    torch._dynamo.reset()
    simulator.reset_stats()
    config = transformers.DistributedConfig(tp_size=tp, fsdp_size=fsdp)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config)
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=3,
        # Large enough that a wrong gradient (not averaged over the FSDP group, or one rank's alone) shows in the
        # loss of steps 2 and 3.
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        torch_compile=True,
        seed=0,
    )
    loss = transformers.Trainer(model=model, args=args, train_dataset=Rows()).train().training_loss
    stats = simulator.stats()
    return {
        "device": str(next(model.parameters()).device),
        "loss": loss,
        "dynamo_graphs": stats["dynamo_graphs"],
        "neffs": stats["compiles"] + stats["compile_cache_hits"],
        "graphs_per_step": sorted({g["graphs_per_step"] for g in stats["steps"]}),
        "breaks": [f"{b['where']}: {b['reason']}" for b in stats["graph_breaks"]],
    }


def main() -> None:
    model_dir, out_dir, tp, fsdp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    report = train(model_dir, out_dir, tp, fsdp)
    if sys.argv[5:] == ["upstream"]:
        os.environ["ACCELERATE_NEURON_FSDP_IMPLEMENTATION"] = "fully_shard"
        report["upstream"] = train(model_dir, out_dir, tp, fsdp)
    _rank_report.finish(out_dir, report)


if __name__ == "__main__":
    main()
