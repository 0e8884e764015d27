"""Used by tests/test_precompile.py: a stock generation script over prompts of several lengths and batch sizes.

    python precompile_generate.py MODEL_DIR [--fail]

Nothing here knows about precompile. It prints one JSON line: the simulator's counts and the cache
keys of the graphs this run handed to the compiler (hits and misses), and what generate() returned.
"""

from __future__ import annotations

import sys

from _precompile_report import print_report
from transformers import AutoModelForCausalLM, AutoTokenizer

from accelerate_neuron import tiny

WORDS = tiny.CORPUS.split()
#: (prompt words, batch size, max_new_tokens): prompt buckets 32 and 64, batch buckets 1, 2 and 4, cache buckets 64
#: and 128; the last call repeats the first one's buckets with another prompt length.
CALLS = [(3, 1, 8), (20, 1, 8), (5, 2, 8), (11, 3, 8), (7, 1, 50), (4, 1, 8)]


def prompt(words: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def main() -> None:
    folder = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    lengths = []
    for i, (words, batch, new) in enumerate(CALLS):
        inputs = tokenizer([prompt(words, i + r) for r in range(batch)], return_tensors="pt", padding=True)
        inputs = inputs.to(model.device)
        output = model.generate(**inputs, max_new_tokens=new, do_sample=False)
        lengths.append([list(inputs["input_ids"].shape), list(output.shape), str(output.device)])
        if "--fail" in sys.argv and i == 2:
            raise RuntimeError("this script fails on purpose on its third prompt")
    print_report(lambda g: g["inputs"][:2], outputs=lengths)


if __name__ == "__main__":
    main()
