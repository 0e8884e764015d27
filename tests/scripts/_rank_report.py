"""The end every ``torchrun`` test script shares: add where this rank ran, write OUT_DIR/rank<r>.json, and end
the process group (a barrier first, so no rank tears down gloo while a peer is still in a collective).

Used by ``tp_step.py`` and ``ep_step.py``; a single-process reference run (no process group) writes rank0.json.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def finish(out_dir: str, report: dict[str, Any]) -> None:
    """Write ``report`` (which names its ``device``) with this rank's placement, then destroy the process group."""
    from accelerate_neuron import simulator

    stats = simulator.stats()
    rank = int(os.environ.get("RANK", 0))
    distributed = torch.distributed.is_initialized()
    report.update(
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=torch.distributed.get_world_size() if distributed else 1,
        physical_core=stats["visible_cores"][torch.device(report["device"]).index or 0],
        visible_cores=stats["visible_cores"],
        visible_cores_env=os.environ.get("NEURON_RT_VISIBLE_CORES"),
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
