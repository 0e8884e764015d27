"""Run by tests/test_moe.py under ``torchrun``: tiny MoE models with expert parallelism, per model one inference
forward, greedy ``generate()``, and one training step (forward with labels and the router's auxiliary loss,
backward, SGD, forward again).

    torchrun --nproc_per_node=N ep_step.py OUT_DIR TP FSDP EP MODEL_DIR [MODEL_DIR ...]

``DistributedConfig(tp_size=TP, fsdp_size=FSDP, ep_size=EP)`` (Transformers >= 5: ``ep_size`` must be a multiple
of ``tp_size`` and divide ``fsdp_size * tp_size``). With TP=FSDP=EP=1 and no torchrun it is the single-process
reference on neuron:0. Each rank writes OUT_DIR/rank<r>.json: per model (keyed by its folder's name) the figures
every rank must agree on, the experts' local shape, and per phase the simulator's counts on this rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import _rank_report
import torch
import transformers
from torch.distributed.tensor import DTensor

LR = 0.5
NEW_TOKENS = 4


def load(model_dir: str, tp: int, fsdp: int, ep: int) -> Any:
    # The router's logits out of every layer: the loss then includes the load-balancing (auxiliary) loss.
    kwargs: dict[str, Any] = {"output_router_logits": True}
    if tp * fsdp * ep == 1:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to("neuron:0")
    config = transformers.DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config, **kwargs)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def counts(since: dict[str, Any]) -> dict[str, Any]:
    """What this rank's simulator recorded since ``since`` (a previous :func:`simulator.stats`)."""
    from accelerate_neuron import simulator

    now = simulator.stats()
    graphs = now["graphs"][len(since["graphs"]) :]
    return {
        "compiles": now["compiles"] - since["compiles"],
        "graph_keys": [g["cache_key"] for g in graphs],
        "breaks": sorted({(g.get("frame") or {}).get("graph_break") or "" for g in graphs} - {""}),
        "compile_cache_hits": now["compile_cache_hits"] - since["compile_cache_hits"],
        "eager_signatures": now["eager_signatures"] - since["eager_signatures"],
        "cpu_fallbacks": now["cpu_fallbacks"] - since["cpu_fallbacks"],
        "cpu_fallback_ops": {
            op: n - since["cpu_fallback_ops"].get(op, 0)
            for op, n in now["cpu_fallback_ops"].items()
            if n != since["cpu_fallback_ops"].get(op, 0)
        },
    }


def run(model: Any) -> dict[str, Any]:
    from accelerate_neuron import simulator

    device = next(model.parameters()).device
    ids = (torch.arange(1, 17).reshape(2, 8) * 37 % 300 + 3).to(device)
    experts = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    report: dict[str, Any] = {
        "device": str(device),
        "experts_implementation": model.config._experts_implementation,
        "local_experts": list((experts.to_local() if isinstance(experts, DTensor) else experts).shape),
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "counts": {},
    }

    simulator.reset_stats()  # each model's counts from zero (the NEFF cache keeps what an earlier model compiled)
    start = simulator.stats()
    model.eval()
    with torch.no_grad():
        logits = full(model(input_ids=ids).logits).float().cpu()
    report["logits_sum"] = float(logits.sum())
    report["logits_head"] = logits.flatten()[:8].tolist()
    report["counts"]["forward"] = counts(start)

    start = simulator.stats()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
    )
    report["tokens"] = full(out)[:, ids.shape[1] :].cpu().tolist()
    report["counts"]["generate"] = counts(start)

    start = simulator.stats()
    model.train()
    out = model(input_ids=ids, labels=ids)
    report["loss0"] = full(out.loss).item()
    report["aux_loss0"] = None if out.aux_loss is None else full(out.aux_loss).item()
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
    model.zero_grad()
    report["counts"]["train_step"] = counts(start)

    # New weights, so another routing: a forward whose shapes follow the token count only adds no eager signature.
    start = simulator.stats()
    out = model(input_ids=ids, labels=ids)
    report["loss1"] = full(out.loss).item()
    report["aux_loss1"] = None if out.aux_loss is None else full(out.aux_loss).item()
    report["counts"]["train_forward_again"] = counts(start)
    return report


def main() -> None:
    out_dir, tp, fsdp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    report: dict[str, Any] = {"models": {}}
    for model_dir in sys.argv[5:]:
        model = load(model_dir, tp, fsdp, ep)
        report["models"][os.path.basename(os.path.normpath(model_dir))] = run(model)
        report["device"] = str(next(model.parameters()).device)
        del model
    _rank_report.finish(out_dir, report)


if __name__ == "__main__":
    main()
