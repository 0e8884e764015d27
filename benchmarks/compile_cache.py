"""The NEFF cache, cold vs warm: the same job run twice in fresh processes sharing one cache folder.

Two workloads on the simulated Neuron device, each run twice as a child process with the
same, initially empty, ``TORCH_NEURONX_NEFF_CACHE_DIR``:

- ``generate``: a stock script, ``from_pretrained(device_map="auto")`` + ``generate()`` (tiny
  Qwen3, greedy, ``max_new_tokens`` fixed) over prompts whose lengths are drawn from a
  log-normal distribution (median ``--median-prompt`` tokens, sigma ``--sigma``, clipped to
  ``--min-prompt``..``--max-prompt``): today's generation path, i.e. decode compiled with a
  static cache in power-of-two length buckets, prefill run eagerly (one eager signature set
  per new prompt length);
- ``train``: one epoch of a stock ``Trainer`` with ``torch_compile=True`` (the workload of
  ``benchmarks/training.py``, plugin defaults: length buckets, bf16), sample lengths
  log-normal (median 64, clipped to 8..512).

Per run: graphs compiled / loaded from the cache, eager signatures compiled / loaded, and the
estimated Trainium compile time from the cost model (``accelerate_neuron.costs``: 60 s per graph, 2 s
per eager signature, 0 s per NEFF loaded; assumptions, not measurements). The child's wall
time is CPU time of the simulator, shown for context only.

    python benchmarks/compile_cache.py [--prompts 24] [--seed 0] [--samples 64] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def prompt_lengths(spec: dict[str, Any]) -> list[int]:
    """Log-normal prompt lengths: most prompts are short, a few are long."""
    rng = random.Random(spec["seed"])
    lo, hi = spec["min_prompt"], spec["max_prompt"]
    return [
        max(lo, min(hi, round(rng.lognormvariate(math.log(spec["median_prompt"]), spec["sigma"]))))
        for _ in range(spec["prompts"])
    ]


def generate_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelerate_neuron import simulator, tiny

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], device_map="auto")
    text_ids = tokenizer(tiny.CORPUS * 8)["input_ids"]
    simulator.reset_stats()
    for n in prompt_lengths(spec):
        ids = torch.tensor([text_ids[:n]])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        inputs = {k: v.to(model.device) for k, v in inputs.items()}  # the stock script's .to(model.device)
        model.generate(**inputs, max_new_tokens=spec["new_tokens"], do_sample=False)
    return _counts(simulator.stats())


def _counts(stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "graphs_compiled": stats["compiles"],
        "graphs_loaded": stats["compile_cache_hits"],
        "eager_compiled": stats["eager_compiles"],
        "eager_loaded": stats["eager_cache_hits"],
    }


def run_child(argv: list[str], cache: Path) -> tuple[dict[str, Any], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_") or k.endswith("CACHE_DIR")}
    env.update({"ACCELERATE_NEURON_SIMULATE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    env["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache)
    env.pop("TORCH_NEURONX_NEFF_DISABLE_CACHE", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), seconds


def _train_counts(result: dict[str, Any]) -> dict[str, Any]:
    if "neuron_graphs" not in result:
        raise SystemExit(f"the Trainer run did not reach the Neuron device: {result}")
    return {
        "graphs_compiled": result["neuron_graphs"],
        "graphs_loaded": result["neuron_graphs_cached"],
        "eager_compiled": result["eager_compiles"],
        "eager_loaded": result["eager_cache_hits"],
    }


def job_row(run: str, argv: list[str], cache: Path, convert: Any = None) -> dict[str, Any]:
    """The job once as a child on ``cache``: its counts, the cost model's estimate, the cache's size after it."""
    from accelerate_neuron import costs
    from accelerate_neuron.simulator import neff_cache

    result, seconds = run_child(argv, cache)
    counts = convert(result) if convert else result
    est = costs.estimate(
        counts["graphs_compiled"],
        counts["eager_compiled"],
        cached_graphs=counts["graphs_loaded"],
        cached_signatures=counts["eager_loaded"],
    )
    entries, size = neff_cache.disk_usage(cache)
    return {"run": run, **counts, "estimate": est, "wall": seconds, "entries": entries, "bytes": size}


def cold_and_warm(argv: list[str], convert: Any = None) -> list[dict[str, Any]]:
    """The job twice on one fresh cache: (cold, warm), with the cache's size after each."""
    with tempfile.TemporaryDirectory(prefix="neff-bench-") as tmp:
        cache = Path(tmp) / "neff"
        return [job_row(run, argv, cache, convert) for run in ("cold", "warm")]


def precompiled(argv: list[str], convert: Any = None) -> tuple[dict[str, Any], dict[str, float]]:
    """``accelerate-neuron precompile`` (1 worker, then 2, each on a fresh cache), then the job on the 2-worker cache.

    Returns the real run's row (with what precompile paid) and precompile's wall time per worker count.
    """
    from accelerate_neuron import costs

    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="neff-bench-pre-") as tmp:
        for jobs in ("1", "2"):
            cache = Path(tmp) / f"neff-{jobs}"
            cmd = ["-m", "accelerate_neuron", "precompile", "--jobs", jobs, "--json", "--", sys.executable, *argv]
            summary, walls[jobs] = run_child(cmd, cache)
        row = job_row("after precompile --jobs 2", argv, cache, convert)
    row["precompile"] = summary
    row["precompile_estimate"] = costs.estimate(summary["graphs_compiled"], summary["eager_compiled"])
    return row, walls


def render(
    spec: dict[str, Any], results: dict[str, list[dict[str, Any]]], command: str, extra: dict[str, Any] | None = None
) -> str:
    import transformers

    from accelerate_neuron.cli._common import duration, size

    lengths = prompt_lengths(spec)
    lines = [
        f"Command: `{command}`",
        "",
        f"transformers {transformers.__version__}; simulated Neuron device, 1 core. `generate`: {spec['prompts']} "
        f"prompts, lengths log-normal (median {spec['median_prompt']}, sigma {spec['sigma']}, clipped to "
        f"{spec['min_prompt']}..{spec['max_prompt']}; drawn: min {min(lengths)}, median "
        f"{sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}, {len(set(lengths))} distinct), "
        f"{spec['new_tokens']} new tokens each, greedy. `train`: 1 epoch, {spec['samples']} samples, lengths "
        "log-normal (median 64, clipped to 8..512), batch 8, bf16, plugin defaults.",
        "",
        "| workload | run | graphs compiled | graphs loaded | eager signatures compiled | eager loaded "
        "| est. Trainium compile | saved by the cache | cache after run | child wall (CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, rows in results.items():
        for r in [*rows, *([extra[workload][0]] if extra and workload in extra else [])]:
            est = r["estimate"]
            lines.append(
                f"| {workload} | {r['run']} | {r['graphs_compiled']} | {r['graphs_loaded']} | {r['eager_compiled']} "
                f"| {r['eager_loaded']} | {duration(est['seconds'])} | {duration(est['saved_seconds'])} "
                f"| {r['entries']} entries, {size(r['bytes'])} | {r['wall']:.1f} s |"
            )
    lines.append("")
    for workload, pre in (extra or {}).items():
        row, walls = pre
        summary = row["precompile"]
        lines.append(
            f"{workload}, precompile first: `accelerate-neuron precompile --jobs 2` on an empty cache compiled "
            f"{summary['graphs_compiled']} graphs and {summary['eager_compiled']} eager signatures "
            f"({duration(row['precompile_estimate']['seconds'])} of Trainium compile, cost model) from "
            f"{summary['shapes']} shapes; the job then compiled {row['graphs_compiled']} graphs and "
            f"{row['eager_compiled']} eager signatures. Precompile's wall time, --jobs 1 vs 2: "
            f"{walls['1']:.1f} s vs {walls['2']:.1f} s (ratio {walls['1'] / walls['2']:.2f}; simulator CPU time "
            "on a shared 2-core machine: the ratio, not the seconds)."
        )
    lines.append("")
    for workload, (cold, warm) in results.items():
        lines.append(
            f"{workload}: estimated compile time cold {duration(cold['estimate']['seconds'])}, warm "
            f"{duration(warm['estimate']['seconds'])} (cost model: 60 s per graph, 2 s per eager signature, "
            "0 s per NEFF loaded)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--median-prompt", type=int, default=24)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--min-prompt", type=int, default=2)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64, help="Trainer samples (1 epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the markdown report here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(generate_child(json.loads(ns.child))))
        return
    if not 1 <= ns.min_prompt <= ns.max_prompt or ns.prompts < 1 or ns.new_tokens < 1:
        parser.error("need 1 <= --min-prompt <= --max-prompt, --prompts >= 1, --new-tokens >= 1")
    from accelerate_neuron import tiny

    with tempfile.TemporaryDirectory(prefix="neff-bench-model-") as folder:
        model = tiny.save_pretrained(Path(folder) / "tiny-qwen3", "qwen3", initializer_range=0.3)
        spec = {
            "model": str(model),
            "prompts": ns.prompts,
            "median_prompt": ns.median_prompt,
            "sigma": ns.sigma,
            "min_prompt": ns.min_prompt,
            "max_prompt": ns.max_prompt,
            "new_tokens": ns.new_tokens,
            "seed": ns.seed,
            "samples": ns.samples,
        }
        train_spec = {
            "samples": ns.samples,
            "batch": 8,
            "min_len": 8,
            "max_len": 512,
            "seed": ns.seed,
            "dist": "lognormal",
            "bf16": True,
        }
        results = {}
        print("generate: cold, then warm ...", file=sys.stderr, flush=True)
        results["generate"] = cold_and_warm([__file__, "--child", json.dumps(spec)])
        print("train: cold, then warm ...", file=sys.stderr, flush=True)
        train = [str(HERE / "training.py"), "--child", json.dumps(train_spec)]
        results["train"] = cold_and_warm(train, convert=_train_counts)
        extra = {}
        print("generate: precompile --jobs 1 and 2, then the job ...", file=sys.stderr, flush=True)
        extra["generate"] = precompiled([__file__, "--child", json.dumps(spec)])
        print("train: precompile --jobs 1 and 2, then the job ...", file=sys.stderr, flush=True)
        extra["train"] = precompiled(train, convert=_train_counts)
    command = ("python benchmarks/compile_cache.py " + " ".join(sys.argv[1:])).strip()
    text = render(spec, results, command, extra)
    print(text)
    if ns.output:
        ns.output.write_text(text)


if __name__ == "__main__":
    main()
