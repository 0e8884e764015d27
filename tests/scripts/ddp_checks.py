"""DDP on 2 ranks: a registered comm hook, join() over uneven inputs, no_sync gradient accumulation.

Run with torchrun; argv: OUT_DIR DEVICE ("neuron" or "cpu": backend neuron or gloo). Each rank writes
rank<N>.json with the final parameters of every case, which the test compares with the gloo/CPU run.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)


def _batches(rank: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=gen) for _ in range(count)]


def run_case(case: str, rank: int, device: torch.device) -> list[list[float]]:
    model = _model(device)
    ddp = DDP(model)
    if case == "hook":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batches = _batches(rank, 3 + rank if case == "join" else 4)
    join = ddp.join() if case == "join" else contextlib.nullcontext()
    with join:
        for i, x in enumerate(batches):
            x = x.to(device)
            accumulate = case == "no_sync" and i % 2 == 0
            with ddp.no_sync() if accumulate else contextlib.nullcontext():
                ddp(x).pow(2).mean().backward()
            if not accumulate:
                opt.step()
                opt.zero_grad()
    return [p.detach().cpu().flatten().tolist() for p in model.parameters()]


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("neuron" if kind == "neuron" else "gloo")
    rank = dist.get_rank()
    device = torch.device("neuron", 0) if kind == "neuron" else torch.device("cpu")
    report = {case: run_case(case, rank, device) for case in ("hook", "join", "no_sync")}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # Without it, stock gloo on CPU aborts now and then at teardown ("terminate called without an active
    # exception", about 1 run in 8 under load, after both ranks wrote their results): one rank destroys its
    # group while the other's last collective is still in flight.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
