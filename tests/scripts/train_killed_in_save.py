"""A Trainer job on the (simulated) Neuron device that dies by SIGKILL, as a preempted or OOM-killed one does.

argv: OUT_DIR [MOMENT]. Trains test_resume's tiny GPT-2 (save_steps=2, max_steps=4). MOMENT:

- ``in-save`` (default): killed inside checkpoint-4's write, after the weights and before
  ``trainer_state.json``: checkpoint-2 is complete, checkpoint-4 is partial.
- ``after-save``: killed right after checkpoint-2 is written (``on_save``), before step 3 starts.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback, TrainerState

from test_resume import _trainer  # tests/ is on PYTHONPATH (see the test)

out, moment = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "in-save")
_save = TrainerState.save_to_json


def dying_save(self: TrainerState, json_path: str) -> None:
    if "checkpoint-4" in json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write('{"global_step": 4, "log_hist')  # torn mid-write, then the process dies
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _save(self, json_path)


class DieAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


if moment == "in-save":
    TrainerState.save_to_json = dying_save
    trainer = _trainer(out)
elif moment == "after-save":
    trainer = _trainer(out)
    trainer.add_callback(DieAfterSave())
else:
    raise SystemExit(f"MOMENT={moment!r}: expected 'in-save' or 'after-save'")
trainer.train()
