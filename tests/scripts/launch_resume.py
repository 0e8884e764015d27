"""Launched by tests/test_resume.py with ``accelerate launch``: a 2-rank Accelerate job killed and resumed.

    accelerate launch --config_file CONFIG launch_resume.py OUT_DIR MODE

MODE ``full`` trains STEPS steps. ``killed`` trains the same job, saves ``accelerator.save_state`` after
step SAVE_AFTER and is SIGKILLed (every rank, no cleanup) at the start of the next step, as a preempted
job is. ``resumed`` is Accelerate's documented recipe: ``load_state``, then ``skip_first_batches`` past
what the checkpoint already trained. Nothing here knows about Neuron. The model has dropout on the
device, the loader shuffles (Accelerate's seedable sampler), AdamW and a scheduler carry state: a resume
that misses any of them, or a core's generator, gives other losses. Each rank writes
OUT_DIR/<MODE>-rank<r>.json with the (mean over ranks) loss of every step it ran and the final weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

sys.path.insert(0, os.path.dirname(__file__))
import accelerate_train

STEPS, SAVE_AFTER, BATCH = 6, 3, 2


class DropoutNet(accelerate_train.Net):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(torch.tanh(self.hidden(x))))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    net = DropoutNet()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * acc.num_processes, accelerate_train.FEATURES, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    net, opt, loader, sched = acc.prepare(net, opt, loader, sched)

    start, batches = 0, loader
    if mode == "resumed":
        acc.load_state(str(out / "state"))
        start, batches = SAVE_AFTER, acc.skip_first_batches(loader, SAVE_AFTER)
    losses = []
    report = out / f"{mode}-rank{acc.process_index}.json"
    for step, (xb, yb) in enumerate(batches, start):
        if mode == "killed" and step == SAVE_AFTER + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(net(xb), yb)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
        if mode == "killed" and step + 1 == SAVE_AFTER:
            acc.save_state(str(out / "state"))
            report.write_text(json.dumps({"losses": losses}))  # what the killed job had logged
    weights = [p.detach().cpu().flatten().tolist() for p in acc.unwrap_model(net).parameters()]
    report.write_text(json.dumps({"losses": losses, "weights": weights, "device": str(acc.device)}))


if __name__ == "__main__":
    main()
