"""Used by tests/test_serving.py: a stock continuous-batching script (``generate_batch``) over prompts of many lengths.

    python precompile_serving.py MODEL_DIR

Nothing here knows about precompile. It prints one JSON line: the simulator's counts, the cache keys of the graphs
this run handed to the compiler (hits and misses), the graphs it compiled and the tokens generate_batch returned.
"""

from __future__ import annotations

import sys

from _precompile_report import print_report
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from accelerate_neuron import tiny

WORDS = tiny.CORPUS.split()
LENGTHS = [3, 9, 17, 30, 44, 61, 12, 5]


def prompt(words: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def main() -> None:
    folder = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    inputs = [tokenizer(prompt(n, i))["input_ids"] for i, n in enumerate(LENGTHS)]
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
    results = model.generate_batch(inputs, generation_config=config)
    print_report(lambda g: [g.get("frame"), g["inputs"][:3]], tokens=[r.generated_tokens for r in results.values()])


if __name__ == "__main__":
    main()
