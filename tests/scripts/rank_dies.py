"""Launched by tests/test_launch.py: a 2-rank Accelerate training loop whose rank 1 dies mid-job.

    accelerate launch --config_file CONFIG rank_dies.py OUT_DIR

Both ranks train accelerate_train's model; at step 2 rank 1 exits at once (``os._exit(7)``, as a
process killed by the OOM killer or a failed core would: no cleanup, no goodbye to the process group),
while rank 0 goes on into the backward pass, whose gradient all-reduce waits for rank 1. Each rank writes
OUT_DIR/rank<r>.steps with the steps it finished, so the test can tell how far rank 0 got.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import accelerate_train

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
acc = Accelerator()
net = accelerate_train.model()
opt = torch.optim.SGD(net.parameters(), lr=accelerate_train.LR)
loader = torch.utils.data.DataLoader(accelerate_train.dataset(acc.num_processes), batch_size=1)
net, opt, loader = acc.prepare(net, opt, loader)
log = out / f"rank{acc.process_index}.steps"
for step, (x, y) in enumerate(loader):
    if step == 2 and acc.process_index == 1:
        os._exit(7)
    loss = torch.nn.functional.mse_loss(net(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    with log.open("a") as f:
        f.write(f"{step}\n")
