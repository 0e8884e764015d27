"""FSDP v1 (FullyShardedDataParallel) and v2 (fully_shard) on 2 ranks: 4 SGD steps, final full weights.

Run with torchrun; argv and report: see rank_cases.py (the parameters are the gathered full ones).
"""

from __future__ import annotations

import rank_cases  # next to this script: on sys.path when run
import torch
import torch.distributed as dist


def _train(wrapped: torch.nn.Module, rank: int, device: torch.device) -> None:
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for x in rank_cases.batches(rank):
        wrapped(x.to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def fsdp1(rank: int, device: torch.device) -> list[list[float]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(rank_cases.model(device), device_id=device, use_orig_params=True)
    _train(model, rank, device)
    with FSDP.summon_full_params(model):
        return [p.detach().cpu().flatten().tolist() for p in model.parameters()]


def fsdp2(rank: int, device: torch.device) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Explicit mesh: without one, fully_shard picks torch.accelerator's type (neuron once the simulator is
    # registered), even for the gloo/CPU reference.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = rank_cases.model(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank, device)
    return [p.full_tensor().detach().cpu().flatten().tolist() for p in model.parameters()]


if __name__ == "__main__":
    rank_cases.run({"fsdp1": fsdp1, "fsdp2": fsdp2})
