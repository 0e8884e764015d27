"""Mixture-of-experts models on (simulated) Neuron: the plugin's static experts vs upstream's, in one run.

A varied-prompt job with stock calls only: ``--prompts`` prompts, one at a time, whose token counts are drawn
from a lognormal distribution (median 12 tokens, sigma 0.9, clipped to 3-120; seed ``--seed``, not one the
defaults were tuned on), each answered with greedy ``generate(max_new_tokens=8)`` on a tiny random Qwen3-MoE and
Mixtral (hidden 64, 2 layers, 4 experts, top-2) loaded with ``device_map="auto"``; then the same prompts through an
eager forward (``disable_bucketing``: op by op, where routing-dependent shapes show). Three modes, each on a fresh
model, Dynamo reset and a cold (memory-only) NEFF cache:

- ``patched``: accelerate-neuron as installed (experts ``auto``);
- ``experts_off``: the same with ``ACCELERATE_NEURON_MOE_EXPERTS=off`` (upstream's ``grouped_mm`` experts, every
  other patch on: bucketed prefill, static cache, compiled decode);
- ``stock``: every patch reverted in this process (stock ``device_map="auto"`` leaves the model on the CPU: it is
  then moved with ``model.to("neuron")``, as a user would).

Per mode: graphs compiled, eager signatures, the cost model's compile time on Trainium
(:mod:`accelerate_neuron.costs`), CPU fallbacks run (host round trips), graphs holding an op the compiler cannot
lower (``host_ops``), and prompts whose tokens differ from the CPU's.

    python benchmarks/moe.py [--prompts 24] [--seed 11]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

import accelerate_neuron
from accelerate_neuron import activation, costs, simulator, tiny
from accelerate_neuron.simulator import neff_cache

WORDS = tiny.CORPUS.split()


def prompts(count: int, seed: int, tokenizer: object) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        want = max(3, min(120, int(rng.lognormvariate(2.48, 0.9))))  # median e^2.48 ~ 12 tokens
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < want:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def run(path: str, texts: list[str], expected: list[torch.Tensor]) -> dict[str, object]:
    tok = tiny.tokenizer()
    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="auto").eval()
    row: dict[str, object] = {"placed": model.device.type}
    if model.device.type != "neuron":  # stock device_map="auto" plans for the CPU only: move it as a user would
        model.to("neuron")
    with neff_cache.temporary():
        simulator.reset_stats()
        differ = 0
        for text, want in zip(texts, expected, strict=True):
            enc = tok([text], return_tensors="pt")
            out = model.generate(**{k: v.to(model.device) for k, v in enc.items()}, max_new_tokens=8, do_sample=False)
            differ += not torch.equal(out.cpu(), want)
        st = simulator.stats()
        row.update(
            graphs=st["compiles"],
            eager=st["eager_signatures"],
            fallbacks=st["cpu_fallbacks"],
            host_op_graphs=sum(bool(g.get("host_ops")) for g in st["graphs"]),
            differ=differ,
        )
        accelerate_neuron.disable_bucketing(model)
        simulator.reset_stats()
        with torch.no_grad():
            for text in texts:
                model(**{k: v.to(model.device) for k, v in tok([text], return_tensors="pt").items()})
        st = simulator.stats()
        row.update(forward_eager=st["eager_signatures"], forward_fallbacks=st["cpu_fallbacks"])
    row["seconds"] = costs.estimate(row["graphs"], row["eager"])["seconds"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    tok = tiny.tokenizer()
    texts = prompts(args.prompts, args.seed, tok)
    lengths = sorted(len(tok(t)["input_ids"]) for t in texts)
    print(
        f"Transformers {transformers.__version__}, torch {torch.__version__}; {len(texts)} prompts, tokens: "
        f"median {lengths[len(lengths) // 2]}, max {lengths[-1]}, distinct lengths {len(set(lengths))}"
    )
    print(
        "| model | mode | graphs | eager signatures | est. compile (s) | CPU fallbacks | graphs with host ops "
        "| eager forward: signatures | eager forward: CPU fallbacks | prompts != CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for family in tiny.MOE_FAMILIES:
            path = str(tiny.save_pretrained(f"{root}/{family}", family, initializer_range=0.3))
            reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            expected = [
                reference.generate(**tok([t], return_tensors="pt"), max_new_tokens=8, do_sample=False) for t in texts
            ]
            rows = {"patched": run(path, texts, expected)}
            os.environ["ACCELERATE_NEURON_MOE_EXPERTS"] = "off"
            rows["experts_off"] = run(path, texts, expected)
            del os.environ["ACCELERATE_NEURON_MOE_EXPERTS"]
            with activation.unpatched():
                rows["stock"] = run(path, texts, expected)
            for mode, r in rows.items():
                print(
                    f"| {family} | {mode} | {r['graphs']} | {r['eager']} | {r['seconds']:.0f} | {r['fallbacks']} "
                    f"| {r['host_op_graphs']} | {r['forward_eager']} | {r['forward_fallbacks']} | {r['differ']} |"
                )


if __name__ == "__main__":
    main()
