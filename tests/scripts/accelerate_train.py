"""Launched by tests/test_launch.py with ``accelerate launch``: a stock Accelerate training loop.

    accelerate launch --config_file CONFIG accelerate_train.py OUT_DIR

(tests/scripts/ray_train.py runs :func:`main` in Ray Train workers.)

Nothing here knows about Neuron. Each rank writes OUT_DIR/rank<r>.json: its
distributed type, device and physical core, the loss of every step (mean over
all ranks), the results of reduce/gather/RNG synchronisation, and the final weights.
:func:`reference` is the same training in one process, in plain PyTorch.
"""

from __future__ import annotations

import json
import os
import sys

import torch

STEPS = 3
BATCH = 4  # per process
FEATURES = 6
LR = 0.1


def dataset(processes: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH * processes, FEATURES, generator=generator)
    y = (x * torch.arange(1.0, FEATURES + 1)).sum(dim=1, keepdim=True).tanh()
    return torch.utils.data.TensorDataset(x, y)


class Net(torch.nn.Module):
    # A user-defined forward: torch.compile traces frames of user code, not torch.nn's own.
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(FEATURES, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def reference(processes: int, device: torch.device) -> dict:
    """One process, global batch = ``processes * BATCH``: what the launched run must reproduce."""
    net = model().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(processes), batch_size=BATCH * processes)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": [p.detach().cpu().flatten().tolist() for p in net.parameters()]}


def main(out_dir: str | None = None) -> None:
    """The loop; ``out_dir`` defaults to argv[1] (a Ray Train worker passes it)."""
    from accelerate import Accelerator

    out_dir = out_dir or sys.argv[1]
    accelerator = Accelerator()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(accelerator.num_processes), batch_size=BATCH)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)

    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    rank_tensor = torch.tensor([accelerator.process_index + 1.0], device=accelerator.device)
    summed = accelerator.reduce(rank_tensor, reduction="sum").item()
    gathered = accelerator.gather(rank_tensor).tolist()
    accelerator.wait_for_everyone()

    # Ranks seeded differently draw the same numbers once rank 0's RNG states are broadcast.
    from accelerate.utils import synchronize_rng_states

    torch.manual_seed(100 + accelerator.process_index)
    generator = torch.Generator().manual_seed(200 + accelerator.process_index)
    synchronize_rng_states(["torch", "generator"], generator)
    draws = torch.tensor([torch.rand(1).item(), torch.rand(1, generator=generator).item()], device=accelerator.device)
    rng_draws = accelerator.gather(draws).tolist()

    from accelerate_neuron import simulator

    stats = simulator.stats()
    inner = getattr(net, "_orig_mod", net)
    report = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "device": str(accelerator.device),
        "physical_core": stats["visible_cores"][accelerator.device.index or 0],
        "visible_cores": stats["visible_cores"],
        "wrapped_in": type(inner).__name__,
        "compiled": inner is not net,
        "compiles": stats["compiles"],
        "compile_cache_hits": stats["compile_cache_hits"],
        "graph_keys": sorted(g["cache_key"] for g in stats["graphs"]),
        "losses": losses,
        "reduce_sum": summed,
        "gather": gathered,
        "rng_draws": rng_draws,
        "weights": [p.detach().cpu().flatten().tolist() for p in accelerator.unwrap_model(net).parameters()],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
