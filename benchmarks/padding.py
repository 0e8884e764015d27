"""Padding and graphs of ``generate()`` jobs on (simulated) Neuron: stock vs ``pow2`` vs ``fit``, in one run.

Positions computed per real one (``accelerate_neuron.padding_stats()``: the prefill's rows x columns against
the tokens the caller's attention mask keeps; a decode step's rows against the caller's rows), compiled graphs
and eager signatures of one job, on a cold NEFF cache and a fresh Dynamo, for three length distributions nobody
tuned the defaults for:

- ``lognormal-48``: prompt lengths lognormal (median 48 tokens, sigma 1, clipped to 4-1,024), batches of 1-8
  prompts (uniform), left padded;
- ``lognormal-64``: the varied-prompt job of ``benchmarks/generation.py`` (median 64, batches 1, 2, 3, 4, 6, 8);
- ``bimodal``: short chat turns (70 %, median 24) and long documents (30 %, median 600), batches of 1-8.

Settings, each on the same prompts (``--batches`` batches from ``--seed + 1``):

- ``stock + static``: every patch reverted, ``cache_implementation="static"`` (upstream pads a batch to its
  longest prompt; its padding is counted from its inputs the same way);
- ``pow2, one prefill``: the buckets' defaults with ``ACCELERATE_NEURON_GROUP_ROWS=0`` (every row of a batch at
  its longest row's bucket: the behaviour before grouped prefill);
- ``pow2``: the defaults (powers of two, grouped prefill);
- ``pow2-half``: ``ACCELERATE_NEURON_PROMPT_BUCKETS=pow2-half`` and ``ACCELERATE_NEURON_BATCH_BUCKETS=pow2-half``
  (two buckets an octave: prompts 16, 24, 32, 48, ...; batches 1, 2, 3, 4, 6, 8, ...);
- ``fit``: ``ACCELERATE_NEURON_PROMPT_BUCKETS=fit`` (batch buckets ``pow2``), fitted to the sizes an earlier
  run of the same job recorded (``--batches`` batches from ``--seed``, run once on ``pow2`` in the same process,
  its record written to a scratch NEFF cache folder, as a previous run of the job would have).

Every setting's tokens are compared with stock's; with ``--sample`` (each call samples, top-k 50 and temperature
0.8, from its own seed, on the device's sampler) with ``pow2, one prefill``'s: the device draws from its own
generator, not the host's, so grouping the prefill must not change a draw, and stock's draws are not comparable.
The per-bucket trend (positions per real one of the prefill, by the pow2 bucket of each prompt, for pow2,
pow2-half and fit) is drawn into ``docs/padding-per-bucket.svg`` (matplotlib).

    python benchmarks/padding.py [--batches 24] [--seed 0] [--new-tokens 4] [--sample] [--only lognormal-48,...]
                                 [--svg docs/padding-per-bucket.svg] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

import accelerate_neuron
from _common import emit, environment, left_padded
from accelerate_neuron import activation, simulator, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.shapes import record
from accelerate_neuron.costs import estimate
from accelerate_neuron.simulator import neff_cache

CONTEXT = 2048
VOCAB = 512
DISTRIBUTIONS = ("lognormal-48", "lognormal-64", "bimodal")
PROMPT_ENV = "ACCELERATE_NEURON_PROMPT_BUCKETS"
BATCH_ENV = "ACCELERATE_NEURON_BATCH_BUCKETS"
GROUP_ENV = "ACCELERATE_NEURON_GROUP_ROWS"


def _lognormal(gen: torch.Generator, count: int, median: float, low: int, high: int) -> list[int]:
    values = torch.empty(count).log_normal_(mean=float(torch.tensor(median).log()), std=1.0, generator=gen)
    return [int(v) for v in values.round().clamp(low, high)]


def lengths_of(distribution: str, count: int, gen: torch.Generator) -> list[int]:
    if distribution == "lognormal-48":
        return _lognormal(gen, count, 48, 4, 1024)
    if distribution == "lognormal-64":
        return _lognormal(gen, count, 64, 8, 1024)
    chat = _lognormal(gen, count, 24, 4, 256)
    documents = _lognormal(gen, count, 600, 128, 1536)
    pick = torch.rand(count, generator=gen) < 0.3
    return [d if p else c for c, d, p in zip(chat, documents, pick.tolist(), strict=True)]


def job(distribution: str, batches: int, seed: int) -> list[list[list[int]]]:
    """``batches`` batches of token-id prompts of the distribution's lengths."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (1, 2, 3, 4, 6, 8) if distribution == "lognormal-64" else tuple(range(1, 9))
    out = []
    for _ in range(batches):
        size = sizes[int(torch.randint(len(sizes), (1,), generator=gen))]
        out.append([torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths_of(distribution, size, gen)])
    return out


def _model():
    return tiny.model("qwen3", vocab_size=VOCAB, initializer_range=0.3, max_position_embeddings=CONTEXT)


def run(model, batches, new_tokens: int, stock: bool = False, sample: bool = False) -> dict:
    """One job on a cold NEFF cache: its outputs, compiles, eager signatures and padding (prefill, decode).

    ``sample``: each call samples (top-k 50, temperature 0.8) from its own seed (1,000 + its index)."""
    torch._dynamo.reset()
    neff_cache.use(None)
    simulator.reset_stats()
    accelerate_neuron.reset_padding_stats()
    outputs, started = [], time.perf_counter()
    per_bucket: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for index, batch in enumerate(batches):
        enc = left_padded(batch)
        before = accelerate_neuron.padding_stats()["generate_prefill"]
        kwargs = {"cache_implementation": "static"} if stock else {}
        if sample:
            kwargs.update(do_sample=True, top_k=50, temperature=0.8)
            torch.manual_seed(1000 + index)
        else:
            kwargs["do_sample"] = False
        if stock and transformers.__version__.startswith("4."):
            enc = {k: v.to(model.device) for k, v in enc.items()}  # 4.x refuses host inputs
        out = model.generate(**enc, max_new_tokens=new_tokens, **kwargs)
        outputs.append(out.cpu())
        if not stock:  # each prompt's share of the prefill, by the pow2 bucket of its length
            after = accelerate_neuron.padding_stats()["generate_prefill"]
            computed, real = after["computed"] - before["computed"], after["real"] - before["real"]
            for prompt in batch:
                bin_ = shapes.round_up_pow2(len(prompt), 32)
                per_bucket[bin_][0] += computed * len(prompt) // max(real, 1)
                per_bucket[bin_][1] += len(prompt)
    stats = simulator.stats()
    padding = accelerate_neuron.padding_stats()
    if stock:  # upstream pads each batch to its longest prompt and decodes every row: counted from its inputs
        real = sum(len(p) for b in batches for p in b)
        padding = {
            "generate_prefill": {"computed": sum(len(b) * max(map(len, b)) for b in batches), "real": real},
            "generate_decode": {"computed": 1, "real": 1},
        }
    return {
        "outputs": outputs,
        "graphs": stats["compiles"],
        "eager": stats["eager_compiles"],
        "prefill": padding["generate_prefill"],
        "decode": padding["generate_decode"],
        "per_bucket": dict(per_bucket),
        "seconds": time.perf_counter() - started,
    }


def _ratio(entry: dict) -> float:
    return entry["computed"] / entry["real"] if entry["real"] else float("nan")


def section(distribution: str, args, trend: dict) -> list[str]:
    history = job(distribution, args.batches, args.seed)
    measured = job(distribution, args.batches, args.seed + 1)
    model = _model().to("neuron")
    runs = {}
    with activation.unpatched():
        runs["stock + static"] = run(model, measured, args.new_tokens, stock=True, sample=args.sample)
    with environment({GROUP_ENV: "0"}):
        runs["pow2, one prefill"] = run(model, measured, args.new_tokens, sample=args.sample)
    runs["pow2"] = run(model, measured, args.new_tokens, sample=args.sample)
    with environment({PROMPT_ENV: "pow2-half", BATCH_ENV: "pow2-half"}):
        runs["pow2-half"] = run(model, measured, args.new_tokens, sample=args.sample)
    with tempfile.TemporaryDirectory(prefix="padding-records-") as folder:
        with environment({"TORCH_NEURONX_NEFF_CACHE_DIR": folder}):
            record.reset()
            # The earlier run of the job: pow2, its sizes recorded.
            run(model, history, args.new_tokens, sample=args.sample)
            record.flush()
            record.reset()  # a new run: fit reads the record
            with environment({PROMPT_ENV: "fit"}):
                runs["fit"] = run(model, measured, args.new_tokens, sample=args.sample)
                key = record.record_key(model)
                fitted = shapes.resolve_policy(CONTEXT, key)
            record.reset()
    # Sampling: the device's sampler draws from the device's generator, not the host's (docs/generation.md), so
    # the patched settings are compared with one prefill's tokens (grouping must not change a draw), stock with
    # nothing.
    compared = "pow2, one prefill" if args.sample else "stock + static"
    reference = runs[compared]["outputs"]
    rows = []
    for name, result in runs.items():
        if args.sample and name == "stock + static":
            same = "n/a (host sampler)"
        else:
            equal = sum(torch.equal(a, b) for a, b in zip(result["outputs"], reference, strict=True))
            same = f"{equal}/{len(reference)}"
        cost = estimate(result["graphs"], result["eager"])
        rows.append(
            f"| {name} | {_ratio(result['prefill']):.2f} | {_ratio(result['decode']):.2f} | {result['graphs']} | "
            f"{result['eager']} | {cost['seconds'] / 60:.0f} min | {same} | "
            f"{result['seconds']:.0f} s |"
        )
        trend.setdefault(distribution, {})[name] = result["per_bucket"]
    lengths = sorted(len(p) for b in measured for p in b)
    mode = "sampled (top-k 50, temperature 0.8, a seed per call) on the device" if args.sample else "greedy"
    return [
        f"#### {distribution}",
        "",
        f"{len(measured)} generate() calls of {len(lengths)} prompts (lengths: min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}), max_new_tokens={args.new_tokens}, {mode}. `fit` "
        f"buckets after the earlier run ({len(history)} calls, seed {args.seed}): prompt "
        f"{list(fitted.prompt_buckets)}, batch {list(fitted.batch_buckets)}; pow2: prompt "
        f"{shapes.pow2_prompt_buckets(CONTEXT).short()}, batch {shapes.pow2_batch_buckets().short()}.",
        "",
        "| setting | prefill positions per real one | decode rows per real one | graphs compiled | eager signatures "
        f"| est. compile (cost model) | calls with {'one prefill' if args.sample else 'stock'}'s tokens | CPU wall |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def draw(trend: dict, path: str) -> None:
    """Positions computed per real one of the prefill, by the pow2 bucket of each prompt's length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(trend), figsize=(4.2 * len(trend), 3.4), squeeze=False)
    for axis, (distribution, settings) in zip(axes[0], trend.items(), strict=True):
        for name, style in (("pow2, one prefill", ":"), ("pow2", "--"), ("pow2-half", "-."), ("fit", "-")):
            bins = settings.get(name) or {}
            xs = sorted(bins)
            axis.plot(xs, [bins[x][0] / bins[x][1] for x in xs], style, marker="o", label=name)
        axis.set_xscale("log", base=2)
        axis.set_title(distribution)
        axis.set_xlabel("prompt length (pow2 bin, tokens)")
        axis.set_ylabel("prefill positions per real one")
        axis.axhline(1.0, color="grey", linewidth=0.6)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=24, help="generate() calls per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the earlier run's prompts (measured: seed + 1)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument(
        "--sample", action="store_true", help="sample on the device (top-k, temperature) instead of greedy decoding"
    )
    parser.add_argument("--only", help="distributions, separated by commas: " + ", ".join(DISTRIBUTIONS))
    parser.add_argument("--svg", default="docs/padding-per-bucket.svg", help="where the per-bucket trend goes")
    parser.add_argument("--output", help="append the markdown section to this file")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(DISTRIBUTIONS)
    unknown = sorted(set(chosen) - set(DISTRIBUTIONS))
    if unknown:
        parser.error(f"--only {unknown}: expected among {', '.join(DISTRIBUTIONS)}")
    trend: dict = {}
    lines = [
        f"### Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, accelerate-neuron "
        f"{accelerate_neuron.__version__})",
        "",
        f"Command: `python {' '.join(sys.argv)}` (simulated device, tiny Qwen3, {CONTEXT}-token context, vocab "
        f"{VOCAB}); each setting on a cold NEFF cache.",
        "",
    ]
    for distribution in chosen:
        lines += section(distribution, args, trend)
    if args.svg:
        draw(trend, args.svg)
        lines.append(f"Per-bucket trend: `{args.svg}`.")
    text = "\n".join(lines)
    emit(text, args.output)


if __name__ == "__main__":
    main()
