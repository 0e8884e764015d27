"""The stock Qwen3 quick-start, unchanged: accelerate-neuron makes it run on Trainium.

Nothing here mentions Neuron. With accelerate-neuron installed, ``import torch``
activates it: ``device_map="auto"`` places the model on NeuronCores, and
``generate()`` keeps its growing tensors on the host, uses a static KV cache
and compiles the decode step once.

    python examples/qwen3_generate.py                      # Qwen/Qwen3-0.6B from the Hub
    MODEL_ID=/path/to/model python examples/qwen3_generate.py

Offline, or without Trainium, use a tiny local model and the simulated device:

    python -c "from accelerate_neuron import tiny; tiny.save_pretrained('./tiny-qwen3')"
    MODEL_ID=./tiny-qwen3 ACCELERATE_NEURON_SIMULATE=2 python examples/qwen3_generate.py
    # or, with a report of placement, compiles and transfers:
    MODEL_ID=./tiny-qwen3 accelerate-neuron simulate -- python examples/qwen3_generate.py
"""

import os
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

model_name = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MODEL_ID", "Qwen/Qwen3-0.6B")

# load the tokenizer and the model
tokenizer = AutoTokenizer.from_pretrained(model_name)
model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype="auto", device_map="auto")

# prepare the model input
prompt = "Give me a short introduction to large language models."
messages = [{"role": "user", "content": prompt}]
if tokenizer.chat_template:  # a tiny local stand-in has no chat template
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
else:
    text = prompt
model_inputs = tokenizer([text], return_tensors="pt").to(model.device)

# conduct text completion
generated_ids = model.generate(**model_inputs, max_new_tokens=int(os.environ.get("MAX_NEW_TOKENS", "32")))
output_ids = generated_ids[0][len(model_inputs.input_ids[0]) :].tolist()

print(f"model device: {model.device}")
print("content:", tokenizer.decode(output_ids, skip_special_tokens=True))
