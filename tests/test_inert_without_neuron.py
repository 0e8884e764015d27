"""Without a Neuron device the plugin changes nothing a user can see."""

from __future__ import annotations

from helpers import last_json, run_python

PROBE = """
import json, sys, tempfile
import torch
import accelerate.utils
import transformers
from transformers import TrainingArguments
from accelerate_neuron import tiny

model = tiny.model("llama")
ids = torch.tensor([[1, 9, 17, 33]])
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
with tempfile.TemporaryDirectory() as tmp:
    args = TrainingArguments(output_dir=tmp, report_to=[], torch_compile=False)
    fields = {k: str(getattr(args, k)) for k in ("device", "bf16", "fp16", "torch_compile_backend",
              "dataloader_drop_last", "dataloader_pin_memory")}
    tiny.save_pretrained(tmp + "/m", "qwen3")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp + "/m", device_map="auto")
    placement = str(loaded.device)
patched = sorted(
    f"{mod}.{name}"
    for mod in ("accelerate.utils", "transformers.generation.utils", "transformers.training_args")
    for name, obj in vars(sys.modules[mod]).items()
    if getattr(obj, "__accelerate_neuron_patch__", None) is not None
)
print(json.dumps({
    "max_memory_keys": sorted(map(str, accelerate.utils.get_max_memory())),
    "tokens": out.tolist(),
    "training_args": fields,
    "placement": placement,
    "accelerator": str(torch.accelerator.current_accelerator()),
    "has_torch_neuron": hasattr(torch, "neuron"),
    "patched": patched,
    "neuron_plugin_loaded": "accelerate_neuron.builtin.placement" in sys.modules,
}))
"""


def test_no_neuron_means_no_visible_change() -> None:
    with_plugin = last_json(run_python(PROBE).stdout)
    # The baseline: the plugin's entry point never runs.
    without = last_json(run_python(PROBE, TORCH_DEVICE_BACKEND_AUTOLOAD="0").stdout)
    assert with_plugin["patched"] == [] and with_plugin["neuron_plugin_loaded"] is False
    for key in ("max_memory_keys", "tokens", "training_args", "placement", "accelerator", "has_torch_neuron"):
        assert with_plugin[key] == without[key], key
    assert with_plugin["max_memory_keys"] == ["cpu"] and with_plugin["placement"] == "cpu"
