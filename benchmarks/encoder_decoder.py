"""Encoder-decoder generate() on (simulated) Neuron: T5, BART and Whisper, patched vs stock upstream, in one run.

Each family (tiny and random: 2 encoder and 2 decoder layers, built offline) generates greedily from one input (a
6-token prompt; one second of Whisper log-mel features) on a Neuron core, with the stock script (inputs moved to
``model.device``): a cold call, then one call per ``--tokens`` count. Per call: graphs compiled, eager op signatures
(what Neuron compiles op by op), and whether the tokens equal the CPU's. Stock runs with every patch reverted in this
process and ``cache_implementation="static"`` (upstream's own recipe for compiling on a device: without it the
cache grows every token). ``--plot`` draws eager signatures per call against new tokens.

    python benchmarks/encoder_decoder.py [--tokens 4 8 16 32] [--output FILE] [--plot docs/encoder-decoder.svg]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

import accelerate_neuron
from _common import emit
from accelerate_neuron import activation, simulator, tiny
from accelerate_neuron.simulator import neff_cache

FAMILIES = ("t5", "bart", "whisper")
PROMPT = "the neuron core runs the compiled graph"


def build(family: str) -> Any:
    if family == "whisper":
        return tiny.speech_model("whisper", init_std=0.3)
    return tiny.model(family, **({"initializer_factor": 3.0} if family == "t5" else {}))


def inputs(family: str) -> dict[str, torch.Tensor]:
    if family == "whisper":
        extractor = tiny.feature_extractor("whisper")
        features = extractor(tiny.audio(1), sampling_rate=tiny.SAMPLING_RATE, return_tensors="pt").input_features
        return {"input_features": features}
    return dict(tiny.tokenizer()([PROMPT], return_tensors="pt"))


def run(family: str, tokens: list[int], stock: bool) -> list[dict[str, Any]]:
    """The cold call (``tokens[0]`` new tokens), then one call per count: graphs, eager signatures, CPU's tokens."""
    torch._dynamo.reset()
    batch = inputs(family)
    reference = build(family)
    extra = {"cache_implementation": "static"} if stock else {}
    rows = []
    with activation.unpatched() if stock else contextlib.nullcontext(), neff_cache.temporary():
        model = build(family).to("neuron")
        for count in [tokens[0], *tokens]:
            simulator.reset_stats()
            try:
                out = model.generate(
                    **{k: v.to("neuron") for k, v in batch.items()}, max_new_tokens=count, do_sample=False, **extra
                )
            except Exception as exc:  # a stock failure is a result
                rows.append({"tokens": count, "error": f"{type(exc).__name__}: {exc}"[:100]})
                continue
            st = simulator.stats()
            expected = reference.generate(**batch, max_new_tokens=count, do_sample=False)
            rows.append(
                {
                    "tokens": count,
                    "graphs": st["compiles"],
                    "eager": st["eager_signatures"],
                    "equal": torch.equal(out.cpu(), expected),
                }
            )
    return rows


def table(results: dict[tuple[str, str], list[dict[str, Any]]], tokens: list[int]) -> list[str]:
    counts = "/".join(str(t) for t in tokens)
    lines = [
        f"| family | scenario | cold call: graphs / eager signatures | warm calls at {counts} new tokens: "
        "eager signatures | graphs compiled by the warm calls | tokens = CPU's |",
        "|---|---|---|---|---|---|",
    ]
    for (family, scenario), rows in results.items():
        if any("error" in r for r in rows):
            error = next(r["error"] for r in rows if "error" in r)
            lines.append(f"| {family} | {scenario} | fails: `{error}` | | | |")
            continue
        cold, warm = rows[0], rows[1:]
        lines.append(
            f"| {family} | {scenario} | {cold['graphs']} / {cold['eager']} | "
            f"{'/'.join(str(r['eager']) for r in warm)} | {sum(r['graphs'] for r in warm)} | "
            f"{'yes' if all(r['equal'] for r in rows) else 'no'} |"
        )
    return lines


def plot(results: dict[tuple[str, str], list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for (family, scenario), rows in results.items():
        warm = [r for r in rows[1:] if "error" not in r]
        if warm:
            style = "-" if scenario == "patched" else "--"
            axis.plot([r["tokens"] for r in warm], [r["eager"] for r in warm], style, marker="o",
                      label=f"{family}, {scenario}")  # fmt: skip
    axis.set_xlabel("new tokens per generate() call")
    axis.set_ylabel("eager op signatures per call")
    axis.set_title("Encoder-decoder generate() on Neuron (warm calls)")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--output", help="append the markdown section to this file")
    parser.add_argument("--plot", metavar="SVG", help="draw eager signatures per call against new tokens")
    args = parser.parse_args()
    if any(t < 1 or t > 200 for t in args.tokens):
        parser.error(f"--tokens must be between 1 and 200, got {args.tokens}")
    results = {}
    for family in FAMILIES:
        for scenario in ("patched", "stock"):
            results[family, scenario] = run(family, args.tokens, stock=scenario == "stock")
    header = (
        f"### Encoder-decoder generate() (Transformers {transformers.__version__}, torch "
        f"{torch.__version__.split('+')[0]}, accelerate-neuron {accelerate_neuron.__version__})"
    )
    command = f"Command: `python benchmarks/encoder_decoder.py --tokens {' '.join(map(str, args.tokens))}`"
    text = "\n".join([header, "", command, "", *table(results, args.tokens), ""])
    emit(text, args.output)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
