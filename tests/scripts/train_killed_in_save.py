"""A Trainer job SIGKILLed while writing its second checkpoint (after the weights, before trainer_state.json).

argv: OUT_DIR. Trains a tiny GPT-2 on the (simulated) Neuron device with save_steps=2, max_steps=4; the
kill is injected inside checkpoint-4's write, so checkpoint-2 is complete and checkpoint-4 is partial.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from transformers import TrainerState

from test_resume import _trainer  # tests/ is on PYTHONPATH (see the test)

_save = TrainerState.save_to_json


def dying_save(self: TrainerState, json_path: str) -> None:
    if "checkpoint-4" in json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write('{"global_step": 4, "log_hist')  # torn mid-write, then the process dies
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _save(self, json_path)


TrainerState.save_to_json = dying_save
_trainer(Path(sys.argv[1])).train()
