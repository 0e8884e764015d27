"""FSDP v1 (FullyShardedDataParallel) and v2 (fully_shard) on 2 ranks: 4 SGD steps, final full weights.

Run with torchrun; argv: OUT_DIR DEVICE ("neuron": backend neuron, or "cpu": gloo). Each rank writes
rank<N>.json with the gathered full parameters per case, which the test compares with the gloo/CPU run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)


def _batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=gen) for _ in range(4)]


def _train(wrapped: torch.nn.Module, rank: int, device: torch.device) -> None:
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for x in _batches(rank):
        wrapped(x.to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def fsdp1(rank: int, device: torch.device) -> list[list[float]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(device), device_id=device, use_orig_params=True)
    _train(model, rank, device)
    with FSDP.summon_full_params(model):
        return [p.detach().cpu().flatten().tolist() for p in model.parameters()]


def fsdp2(rank: int, device: torch.device) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Explicit mesh: without one, fully_shard picks torch.accelerator's type (neuron once the simulator is
    # registered), even for the gloo/CPU reference.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = _model(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank, device)
    return [p.full_tensor().detach().cpu().flatten().tolist() for p in model.parameters()]


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("neuron" if kind == "neuron" else "gloo")
    rank = dist.get_rank()
    device = torch.device("neuron", 0) if kind == "neuron" else torch.device("cpu")
    report = {}
    for name, case in (("fsdp1", fsdp1), ("fsdp2", fsdp2)):
        try:
            report[name] = case(rank, device)
        except Exception as exc:  # reported per case, so one failing version does not hide the other
            report[name] = f"{type(exc).__name__}: {exc}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
