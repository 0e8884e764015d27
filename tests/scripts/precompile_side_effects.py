"""Used by tests/test_precompile.py: a stock generate() script with a side effect of its own.

    python precompile_side_effects.py OUT.json

It generates on the CPU and on the device and writes both results to OUT.json (what a script's own
output file is), with whether it ran as a warm-up, the warnings the plugin gave, and the
ACCELERATE_NEURON_* / TORCH_NEURONX_* environment it ran in.
"""

from __future__ import annotations

import json
import logging
import os
import sys

heard: list[str] = []


class _Heard(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        heard.append(record.getMessage())


logging.getLogger("accelerate_neuron").addHandler(_Heard(logging.WARNING))  # before import torch: activation's too

import torch  # noqa: E402

import accelerate_neuron  # noqa: E402
from accelerate_neuron import tiny  # noqa: E402

model = tiny.model("llama")
prompt = torch.tensor([[1, 5, 7, 9]])
cpu = model.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist()
neuron = model.to("neuron").generate(prompt.to("neuron"), max_new_tokens=4, do_sample=False)[0].cpu().tolist()
result = {
    "cpu": cpu,
    "neuron": neuron,
    "warming_up": accelerate_neuron.is_warming_up(),
    "heard": heard,
    "env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_NEURON_", "TORCH_NEURONX_"))},
}
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(result, out)
