"""Soak on a simulated Neuron core: many ``generate()`` calls and a long Trainer run, patched vs stock.

A long job must not creep: device memory back to what the model holds after every call, host memory
flat, no compile after warm-up once every shape has been seen. Each mode runs in its own child process
(clean RSS, cold memory-only NEFF cache):

- ``generate``: ``--calls`` greedy ``generate()`` calls (``max_new_tokens`` 8 or 16) on a tiny Qwen3
  (2,048-token context) on ``neuron:0``. Prompt lengths are lognormal (median 32 tokens, sigma 1.0,
  clipped to 4-512), batches of 1-4 prompts (uniform), right-trimmed and left padded as a tokenizer
  does; ``--distinct N`` draws N such batches and cycles through them (the tests use it so that every
  shape is seen during warm-up). After every call: ``memory_allocated(0)`` minus the weights and what
  upstream keeps on purpose between calls (Transformers 4.x holds its static cache in
  ``model._cache``), which must be 0; host RSS (psutil) every 50 calls; compiles (graphs + eager
  signatures) after ``--warmup`` calls.
- ``train``: ``Trainer`` (bf16, ``torch_compile``, the plugin's length buckets) for ``--steps`` steps
  over lognormal lengths (median 48, sigma 0.9, clipped to 8-256), batch 4, AdamW: device memory at
  every step end less the step's batch (the loop still holds it; its size follows the bucket), which
  after the first step (optimizer state created) must not move; RSS every 50 steps, compiles after
  ``--train-warmup`` steps.

``patched`` is accelerate-neuron as installed; ``stock`` is every patch off
(``ACCELERATE_NEURON_DISABLE=all``) with the seed's recipe for generate (``cache_implementation="static"``,
inputs moved to the model's device) and the stock Trainer (5.x compiles on ``neuron:0`` with dynamic
shapes off; 4.57 trains on the CPU and is reported, not run).

    python benchmarks/soak.py [--calls 1000] [--warmup 100] [--steps 500] [--train-warmup 50]
                              [--distinct N] [--modes patched,stock] [--seed 0] [--json] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RSS_EVERY = 50
MODES = {"patched": {}, "stock": {"ACCELERATE_NEURON_DISABLE": "all"}}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _compiled(stats: dict[str, Any]) -> int:
    return stats["compiles"] + stats["eager_compiles"]


def _kept_bytes(model: Any) -> int:
    """Device bytes upstream keeps between generate() calls by design: 4.x's ``model._cache``."""
    cache = getattr(model, "_cache", None)
    if cache is None:
        return 0
    caches = [getattr(cache, "self_attention_cache", cache), getattr(cache, "cross_attention_cache", None)]
    total = 0
    for part in caches:
        for layer in getattr(part, "layers", None) or []:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if tensor is not None and tensor.device.type == "neuron":
                    total += tensor.numel() * tensor.element_size()
        for name in ("key_cache", "value_cache"):  # older layouts
            for tensor in getattr(part, name, None) or []:
                if tensor.device.type == "neuron":
                    total += tensor.numel() * tensor.element_size()
    return total


def _batches(spec: dict[str, Any], vocab: int) -> list[list[list[int]]]:
    import random

    rng = random.Random(spec["seed"])
    count = spec["distinct"] or spec["calls"]
    batches = []
    for _ in range(count):
        rows = rng.randint(1, 4)
        lengths = [max(4, min(512, round(rng.lognormvariate(math.log(32), 1.0)))) for _ in range(rows)]
        batches.append([[rng.randrange(3, vocab) for _ in range(n)] for n in lengths])
    return [batches[i % count] for i in range(spec["calls"])]


def generate_child(spec: dict[str, Any], stock: bool) -> dict[str, Any]:
    import gc

    import torch

    from accelerate_neuron import simulator, tiny

    model = tiny.model("qwen3", max_position_embeddings=2048).to("neuron:0")
    weights = torch.neuron.memory_allocated(0)
    batches = _batches(spec, model.config.vocab_size)
    leaks, compiled_after, rss = [], [], []
    simulator.reset_stats()
    start = time.perf_counter()
    for call, batch in enumerate(batches):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        inputs = {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
        extra = {"cache_implementation": "static"} if stock else {}
        new = 8 if call % 3 else 16
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new, pad_token_id=0, **extra)
        assert out.shape[0] == len(batch)
        del out, inputs
        gc.collect()
        leaks.append(torch.neuron.memory_allocated(0) - weights - _kept_bytes(model))
        if call + 1 == spec["warmup"]:
            warm = _compiled(simulator.stats())
        if call + 1 >= spec["warmup"] and (call + 1 - spec["warmup"]) % RSS_EVERY == 0:
            rss.append(_rss())
        if call + 1 > spec["warmup"]:
            compiled_after.append(_compiled(simulator.stats()) - warm)
    seconds = time.perf_counter() - start
    rss.append(_rss())
    stats = simulator.stats()
    return {
        "calls": len(batches),
        "distinct_batches": spec["distinct"] or len(batches),
        "leaked_bytes_max": max(leaks),
        "calls_with_leak": sum(1 for x in leaks if x),
        "kept_by_upstream_bytes": _kept_bytes(model),
        "compiled_total": _compiled(stats),
        "graphs": stats["compiles"],
        "eager_signatures": stats["eager_signatures"],
        "compiled_after_warmup": compiled_after[-1] if compiled_after else 0,
        "first_compile_after_warmup": next((i + spec["warmup"] + 1 for i, c in enumerate(compiled_after) if c), None),
        "rss_after_warmup": rss[0],
        "rss_end": rss[-1],
        "rss_max": max(rss),
        "seconds": seconds,
    }


def train_child(spec: dict[str, Any]) -> dict[str, Any]:
    import random
    import tempfile

    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    from accelerate_neuron import simulator, tiny

    rng = random.Random(spec["seed"])
    lengths = [max(8, min(256, round(rng.lognormvariate(math.log(48), 0.9)))) for _ in range(4 * spec["steps"])]
    features = [{"input_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in lengths]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        torch_compile=True,
        bf16=True,
        per_device_train_batch_size=4,
        max_steps=spec["steps"],
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
    )
    if args.device.type != "neuron":
        return {"not_run": f"the stock Trainer trains on {args.device.type}, not on Neuron"}

    class Watch(TrainerCallback):
        def __init__(self) -> None:
            self.memory: list[int] = []
            self.rss: list[int] = []
            self.compiled: list[int] = []
            self.batch_bytes = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = state.global_step
            self.memory.append(torch.neuron.memory_allocated(0) - self.batch_bytes)
            self.compiled.append(_compiled(simulator.stats()))
            if step >= spec["train_warmup"] and (step - spec["train_warmup"]) % RSS_EVERY == 0:
                self.rss.append(_rss())

    watch = Watch()
    trainer = Trainer(
        model=tiny.model("llama", max_position_embeddings=256),
        args=args,
        train_dataset=features,
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        callbacks=[watch],
    )
    training_step = trainer.training_step

    def counted_step(model: Any, inputs: Any, *rest: Any, **kwargs: Any) -> Any:
        watch.batch_bytes = sum(
            v.numel() * v.element_size()
            for v in inputs.values()
            if isinstance(v, torch.Tensor) and v.device.type == "neuron"
        )
        return training_step(model, inputs, *rest, **kwargs)

    trainer.training_step = counted_step
    simulator.reset_stats()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    watch.rss.append(_rss())
    after_first = watch.memory[1:]
    warm = watch.compiled[spec["train_warmup"] - 1]
    return {
        "steps": len(watch.memory),
        "memory_first_step": watch.memory[0],
        "memory_moves_after_first_step": sum(1 for m in after_first if m != watch.memory[0]),
        "memory_span_after_first_step": (max(after_first) - min(after_first)) if after_first else 0,
        "compiled_total": watch.compiled[-1],
        "compiled_after_warmup": watch.compiled[-1] - warm,
        "rss_after_warmup": watch.rss[0],
        "rss_end": watch.rss[-1],
        "rss_max": max(watch.rss),
        "seconds": seconds,
    }


def child(spec: dict[str, Any], mode: str) -> dict[str, Any]:
    import torch

    torch._dynamo.config.cache_size_limit = 8  # Dynamo's default; stated so a changed default shows
    out: dict[str, Any] = {}
    if spec["calls"]:
        out["generate"] = generate_child(spec, stock=mode == "stock")
    if spec["steps"]:
        torch._dynamo.reset()
        out["train"] = train_child(spec)
    return out


def run_mode(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_") or k.endswith("CACHE_DIR")}
    env.update({"ACCELERATE_NEURON_SIMULATE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    env["TORCH_NEURONX_NEFF_DISABLE_CACHE"] = "1"  # a first run: nothing compiled by an earlier one
    env.update(MODES[mode])
    cmd = [sys.executable, __file__, "--child", mode, "--spec", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: int) -> str:
    return f"{n / 2**20:+.1f} MiB" if n else "0 MiB"


def report(spec: dict[str, Any], results: dict[str, dict[str, Any]], command: str) -> str:
    import accelerate
    import torch
    import transformers

    lines = [
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}; "
        f"one simulated core; NEFF cache cold (memory only).",
        "",
    ]
    if spec["calls"]:
        distinct = f"{spec['distinct']} distinct batches cycled" if spec["distinct"] else "every batch new"
        lines += [
            f"generate: {spec['calls']} calls ({distinct}), warm-up {spec['warmup']} calls; prompt lengths lognormal "
            "(median 32, sigma 1, 4-512), batches of 1-4, max_new_tokens 8/16.",
            "",
            "| mode | device bytes left after a call (max; calls) | kept by upstream (4.x `_cache`) | graphs | "
            "eager signatures | compiles after warm-up (first at call) | RSS after warm-up -> end (max) | CPU wall |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mode, r in results.items():
            g = r.get("generate")
            if g is None:
                continue
            first = f" (call {g['first_compile_after_warmup']})" if g["first_compile_after_warmup"] else ""
            lines.append(
                f"| {mode} | {g['leaked_bytes_max']} B; {g['calls_with_leak']} | {g['kept_by_upstream_bytes']:,} B | "
                f"{g['graphs']} | {g['eager_signatures']} | {g['compiled_after_warmup']}{first} | "
                f"{g['rss_after_warmup'] / 2**20:.0f} MiB {_mib(g['rss_end'] - g['rss_after_warmup'])} "
                f"({_mib(g['rss_max'] - g['rss_after_warmup'])}) | {g['seconds']:.0f} s |"
            )
        lines.append("")
    if spec["steps"]:
        lines += [
            f"train: {spec['steps']} Trainer steps (bf16, torch_compile, batch 4, AdamW), warm-up "
            f"{spec['train_warmup']} steps; sample lengths lognormal (median 48, sigma 0.9, 8-256).",
            "",
            "| mode | device memory at step end, less the batch: steps it moved after step 1 (span) "
            "| compiles (after warm-up) | RSS after warm-up -> end (max) | CPU wall |",
            "|---|---|---|---|---|",
        ]
        for mode, r in results.items():
            t = r.get("train")
            if t is None:
                continue
            if "not_run" in t:
                lines.append(f"| {mode} | not run: {t['not_run']} | | | |")
                continue
            lines.append(
                f"| {mode} | {t['memory_moves_after_first_step']} ({t['memory_span_after_first_step']} B) | "
                f"{t['compiled_total']} ({t['compiled_after_warmup']}) | "
                f"{t['rss_after_warmup'] / 2**20:.0f} MiB {_mib(t['rss_end'] - t['rss_after_warmup'])} "
                f"({_mib(t['rss_max'] - t['rss_after_warmup'])}) | {t['seconds']:.0f} s |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--train-warmup", type=int, default=50)
    parser.add_argument("--distinct", type=int, default=0, help="cycle through N distinct batches (0: all new)")
    parser.add_argument("--modes", default="patched,stock")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the raw results as one JSON line")
    parser.add_argument("--output", help="also write the report to FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.spec), args.child)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: expected a comma-separated subset of {list(MODES)}")
    for name in ("calls", "steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} {getattr(args, name)}: expected 0 or more")
    if args.calls and not 0 < args.warmup < args.calls:
        parser.error(f"--warmup {args.warmup}: expected between 1 and --calls - 1 ({args.calls - 1})")
    if args.steps and not 0 < args.train_warmup < args.steps:
        parser.error(f"--train-warmup {args.train_warmup}: expected between 1 and --steps - 1 ({args.steps - 1})")
    spec = {
        "calls": args.calls,
        "warmup": args.warmup,
        "steps": args.steps,
        "train_warmup": args.train_warmup,
        "distinct": args.distinct,
        "seed": args.seed,
    }
    results = {mode: run_mode(mode, spec) for mode in modes}
    if args.json:
        print(json.dumps(results))
        return
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    text = report(spec, results, command.strip())
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
