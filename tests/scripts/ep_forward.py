"""Run by tests/test_moe.py under ``torchrun``: a tiny Qwen3-MoE with expert parallelism, one inference forward.

    torchrun --nproc_per_node=N ep_forward.py MODEL_DIR OUT_DIR EP_SIZE

``DistributedConfig(tp_size=EP_SIZE, ep_size=EP_SIZE)`` (Transformers >= 5: ``ep_size`` must be a multiple of
``tp_size`` and divide ``fsdp_size * tp_size``). With EP_SIZE=1 and no torchrun it is the single-process reference.
Each rank writes OUT_DIR/rank<r>.json: its logits' figures, its core, the experts' local shape.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from torch.distributed.tensor import DTensor


def main() -> None:
    model_dir, out_dir, ep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if ep == 1:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to("neuron:0")
    else:
        config = transformers.DistributedConfig(tp_size=ep, ep_size=ep)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config)
    model.eval()
    device = next(model.parameters()).device
    ids = (torch.arange(1, 17).reshape(2, 8) * 37 % 300 + 3).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float().cpu()
    experts = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    from accelerate_neuron import simulator

    stats = simulator.stats()
    rank = int(os.environ.get("RANK", 0))
    report = {
        "rank": rank,
        "device": str(device),
        "physical_core": stats["visible_cores"][device.index or 0],
        "experts_implementation": model.config._experts_implementation,
        "local_experts": list((experts.to_local() if isinstance(experts, DTensor) else experts).shape),
        "logits_sum": float(logits.sum()),
        "logits_head": logits.flatten()[:8].tolist(),
        "cpu_fallbacks": stats["cpu_fallbacks"],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
