"""What the 2-rank DDP/FSDP check scripts share: the model, each rank's batches, and the run itself.

A script calls :func:`run` with its cases; argv: OUT_DIR DEVICE ("neuron": backend neuron, or "cpu": gloo).
Each rank writes rank<N>.json with every case's final parameters (or its error, so one failing case does
not hide the others), which the test compares with the gloo/CPU run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

Case = Callable[[int, torch.device], list[list[float]]]


def model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)


def batches(rank: int, count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=gen) for _ in range(count)]


def run(cases: dict[str, Case]) -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("neuron" if kind == "neuron" else "gloo")
    rank = dist.get_rank()
    device = torch.device("neuron", 0) if kind == "neuron" else torch.device("cpu")
    report: dict[str, object] = {}
    for name, case in cases.items():
        try:
            report[name] = case(rank, device)
        except Exception as exc:
            report[name] = f"{type(exc).__name__}: {exc}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # Stock gloo on CPU aborted now and then after both ranks wrote their results ("terminate called without
    # an active exception", SIGABRT: about 1 run in 8 under load without the barrier, 1 in 50 with it). The
    # cases' models and FSDP state sit in reference cycles holding gloo work objects; freed during interpreter
    # finalization they abort (see pytorch/pytorch#179291). So: free them while Python is alive, wait for the
    # peer, destroy the groups, and leave without finalization. The numbers, not torch's exit path, are
    # under test; every other launch test exits normally.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
