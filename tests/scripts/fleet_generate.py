"""Used by tests/test_remote_cache.py: one "host" of a fleet, a stock generation script.

    python fleet_generate.py MODEL_DIR

Nothing here knows about the remote cache. It prints one JSON line: the tokens generate() returned, the
simulator's compile counts, and what the remote tier did (fetched, published, refused, down).
"""

from __future__ import annotations

import json
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from accelerate_neuron import simulator

PROMPTS = ["the neuron core", "a fleet compiles once and every host loads the same graphs"]


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto")
    tokens = []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        tokens.append(model.generate(**inputs, max_new_tokens=4, do_sample=False)[0].tolist())
    st = simulator.stats()
    keep = ("compiles", "compile_cache_hits", "eager_compiles", "eager_cache_hits", "eager_signatures")
    report = {k: st[k] for k in keep}
    report["graph_keys"] = sorted(g["cache_key"] for g in st["graphs"])
    report["graph_sources"] = sorted(g["cache_source"] for g in st["graphs"])
    report["remote"] = st["compile_cache"].get("remote")
    print(json.dumps({"tokens": tokens, **report}))


if __name__ == "__main__":
    main()
