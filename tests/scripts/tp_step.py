"""Run by tests/test_launch.py under ``torchrun``: a tiny causal LM loaded with tensor parallelism
(and FSDP where Transformers has it), one forward + backward + SGD step, then a second forward.

    torchrun --nproc_per_node=N tp_step.py MODEL_DIR OUT_DIR TP_SIZE FSDP_SIZE

Each rank writes OUT_DIR/rank<r>.json. With TP_SIZE=FSDP_SIZE=1 and no torchrun it is the
single-process reference.
"""

from __future__ import annotations

import dataclasses
import sys

import _rank_report
import torch
import transformers
from torch.distributed.tensor import DTensor

LR = 0.5


def load(model_dir: str, tp: int, fsdp: int):
    if tp == 1 and fsdp == 1:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir).to("neuron:0")
    config_cls = getattr(transformers, "DistributedConfig", None)
    fields = {f.name for f in dataclasses.fields(config_cls)} if config_cls is not None else set()
    if {"tp_size", "fsdp_size"} <= fields:
        dist_config = config_cls(tp_size=tp, fsdp_size=fsdp)
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=dist_config)
    if fsdp != 1:
        raise SystemExit(f"transformers {transformers.__version__}: DistributedConfig has no fsdp_size")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", tp_size=tp)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model) -> dict:
    """Forward + backward + one SGD step + forward: the figures every rank must agree on."""
    model.train()
    dev = next(p for p in model.parameters()).device
    ids = (torch.arange(1, 17, dtype=torch.long).reshape(2, 8) % 300 + 3).to(dev)
    out = model(input_ids=ids, labels=ids)
    loss0 = full(out.loss).item()
    logits = full(out.logits).detach().float().cpu()
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
    model.zero_grad()
    loss1 = full(model(input_ids=ids, labels=ids).loss).item()
    return {
        "device": str(dev),
        "loss0": loss0,
        "loss1": loss1,
        "logits_sum": float(logits.sum()),
        "logits_head": logits.flatten()[:8].tolist(),
    }


def main() -> None:
    model_dir, out_dir, tp, fsdp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model = load(model_dir, tp, fsdp)
    report = step(model)
    report["dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
    _rank_report.finish(out_dir, report)


if __name__ == "__main__":
    main()
