"""``notebook_launcher(fn, num_processes=2)`` as a notebook cell runs it: gather + 3 DDP steps per rank.

argv: OUT_DIR. Each rank writes rank<N>.json (device, physical core, gathered values, final loss).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import notebook_launcher


def train(out: str) -> None:
    import torch
    from accelerate import Accelerator

    from accelerate_neuron import simulator, tiny

    acc = Accelerator(mixed_precision="bf16")
    gathered = acc.gather(torch.full((2,), float(acc.process_index + 1), device=acc.device))
    torch.manual_seed(0)
    model = tiny.model("qwen3")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(acc.process_index)).to(acc.device)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    first = next(acc.unwrap_model(model).parameters()).detach().float().cpu()
    report = {
        "rank": acc.process_index,
        "device": str(acc.device),
        "distributed_type": str(acc.distributed_type),
        "visible_cores": simulator.stats()["visible_cores"],
        "physical_core": simulator.stats()["visible_cores"][0],
        "gathered": gathered.cpu().tolist(),
        "param_sum": float(first.sum()),
    }
    Path(out, f"rank{acc.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    notebook_launcher(train, args=(sys.argv[1],), num_processes=2)
