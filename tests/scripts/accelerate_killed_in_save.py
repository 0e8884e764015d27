"""Run by tests/test_resume.py in a child: an Accelerate loop with automatic checkpoint naming, SIGKILLed
inside its second ``save_state``.

    python accelerate_killed_in_save.py PROJECT_DIR

Four steps of tiny GPT-2 (dropout on the device); ``save_state()`` after steps 2 and 4, into
PROJECT_DIR/checkpoints/checkpoint_0 and checkpoint_1. The second save is killed while it writes
``random_states_0.pkl``, the last file Accelerate writes: half its bytes reach the disk, then SIGKILL,
as a preempted job's would. Everything before it in checkpoint_1 (weights, optimizer) is complete.
"""

from __future__ import annotations

import io
import os
import signal
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from accelerate_neuron import tiny

_real_save = torch.save
_saves = 0


def _save(obj, f, *args, **kwargs):
    if str(f).endswith("random_states_0.pkl") and _saves == 1:
        buffer = io.BytesIO()
        _real_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_save(obj, f, *args, **kwargs)


def main() -> None:
    global _saves
    torch.save = _save
    project = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
    acc = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = tiny.model("gpt2", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        ids = torch.randint(3, 300, (2, 16), generator=gen).to(acc.device)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:
            acc.save_state()
            _saves += 1


if __name__ == "__main__":
    main()
