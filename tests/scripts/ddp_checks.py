"""DDP on 2 ranks: a registered comm hook, join() over uneven inputs, no_sync gradient accumulation.

Run with torchrun; argv and report: see rank_cases.py.
"""

from __future__ import annotations

import contextlib
import functools

import rank_cases  # next to this script: on sys.path when run
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def run_case(case: str, rank: int, device: torch.device) -> list[list[float]]:
    model = rank_cases.model(device)
    ddp = DDP(model)
    if case == "hook":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batches = rank_cases.batches(rank, 3 + rank if case == "join" else 4)
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


if __name__ == "__main__":
    rank_cases.run({case: functools.partial(run_case, case) for case in ("hook", "join", "no_sync")})
