"""Trainer with ``torch_compile=True`` on a simulated Neuron core: graphs per epoch, patched vs upstream.

One epoch of a stock ``Trainer`` (tiny Llama, ``DataCollatorForLanguageModeling``)
over samples whose lengths are drawn from ``--min-len``..``--max-len`` tokens,
in three child processes on the simulated device:

- ``upstream``: the training plugin disabled (``ACCELERATE_NEURON_DISABLE=training``),
  i.e. stock Transformers/Accelerate. Transformers 5 compiles with the
  ``"neuron"`` backend on ``neuron:0``; 4.57 trains on the CPU with inductor,
  which never reaches Neuron (reported, not run);
- ``buckets off``: the plugin with ``ACCELERATE_NEURON_TRAIN_BUCKETS=off``:
  the plugin's device, bf16 and compile defaults with upstream's batch shapes;
- ``plugin``: the defaults (length buckets, ``dataloader_drop_last=True``).

Reported per run: Dynamo graphs and Neuron graphs (AOTAutograd forward +
backward graphs handed to the ``"neuron"`` backend: each is a NEFF compile on
Trainium), distinct sequence lengths compiled, Dynamo recompile-limit hits
(the frame then runs eagerly: Neuron's eager mode compiles op by op),
eager signatures, padding overhead, wall time. The simulator runs on the CPU
and does not model compile time: the Trainium compile estimate uses the
25-140 s per graph of the design notes, and step times are CPU step times.

    python benchmarks/training.py [--samples 256] [--batch 8] [--min-len 8] [--max-len 512]
                                  [--dist uniform|lognormal] [--seed N] [--scenario trainer|trl-sft]
                                  [--trl-pad-to-multiple-of auto|none|N]
                                  [--fp32] [--output FILE]

``--scenario trl-sft``: TRL's ``SFTTrainer`` with a LoRA ``peft_config`` on
pre-tokenized samples: TRL's own collator (not a Transformers one) builds
the batches, which the plugin pads at Accelerate's prepared dataloader.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NEFF_SECONDS = (25, 140)  # per compiled graph on Trainium (the range accelerate_neuron.costs describes)
MODES = {
    "upstream": {"ACCELERATE_NEURON_DISABLE": "training"},
    "buckets off": {"ACCELERATE_NEURON_TRAIN_BUCKETS": "off"},
    "plugin": {},
}


def draw_length(rng: Any, spec: dict[str, Any]) -> int:
    """A sample length: uniform, or log-normal (median 64 tokens: most text is short, a few samples are long)."""
    if spec["dist"] == "uniform":
        return rng.randint(spec["min_len"], spec["max_len"])
    return max(spec["min_len"], min(spec["max_len"], round(rng.lognormvariate(math.log(64), 0.9))))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import logging
    import random
    import tempfile

    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    from accelerate_neuron import simulator, tiny

    class Hits(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
                self.count += 1

    hits = Hits()
    logging.getLogger("torch._dynamo").addHandler(hits)

    rng = random.Random(spec["seed"])
    lengths = [draw_length(rng, spec) for _ in range(spec["samples"])]
    features = [{"input_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in lengths]
    trl = spec.get("scenario") == "trl-sft"
    if trl:  # TRL's SFTConfig is a TrainingArguments; TRL's own collator pads each batch to its longest sample
        from trl import SFTConfig as TrainingArguments
    try:
        extra = {"max_length": spec["max_len"], "pad_to_multiple_of": spec["trl_multiple"]} if trl else {}
        args = TrainingArguments(
            **extra,
            output_dir=tempfile.mkdtemp(),
            torch_compile=True,
            bf16=spec["bf16"],
            per_device_train_batch_size=spec["batch"],
            num_train_epochs=1,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
        )
    except ValueError as exc:  # e.g. Transformers 4.57 refuses bf16 without CUDA
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {
        "device": args.device.type,
        "backend": args.torch_compile_backend,
        "drop_last": args.dataloader_drop_last,
    }
    if args.device.type != "neuron":
        return out

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, int]] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.graphs = simulator.stats()["dynamo_graphs"]
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.rows.append((time.perf_counter() - self.start, simulator.stats()["dynamo_graphs"] - self.graphs))

    steps = Steps()
    model = tiny.model("llama", max_position_embeddings=spec["max_len"])
    if trl:
        from datasets import Dataset
        from peft import LoraConfig
        from trl import SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(features),  # pre-tokenized: TRL keeps the lengths drawn here
            processing_class=tiny.tokenizer(),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            callbacks=[steps],
        )
    else:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=features,
            data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
            callbacks=[steps],
        )
    simulator.reset_stats()
    start = time.perf_counter()
    loss = trainer.train().training_loss
    epoch = time.perf_counter() - start
    stats = simulator.stats()
    seq = {}
    for graph in stats["graphs"]:
        for item in graph["dynamo_inputs"]:
            if "input_ids" in item["name"]:
                seq[graph["dynamo_graph"]] = item["shape"][1]
    real = padded = 0
    shapes = set()
    for batch in trainer.get_train_dataloader():  # the same collator path, one more pass
        padded += batch["input_ids"].numel()
        real += int(batch["attention_mask"].sum())
        shapes.add(tuple(batch["input_ids"].shape))
    steady = [s for s, g in steps.rows if g == 0]
    compiling = [s for s, g in steps.rows if g > 0]
    out.update(
        steps=len(steps.rows),
        loss=loss,
        dynamo_graphs=stats["dynamo_graphs"],
        neuron_graphs=stats["compiles"],
        neuron_graphs_cached=stats["compile_cache_hits"],
        eager_compiles=stats["eager_compiles"],
        eager_cache_hits=stats["eager_cache_hits"],
        lengths_compiled=sorted(set(seq.values())),
        batch_shapes=len(shapes),
        recompile_limit_hits=hits.count,
        eager_signatures=stats["eager_signatures"],
        padding_overhead=padded / real - 1 if real else None,  # a precompile worker may see no batch
        epoch_seconds=epoch,
        steady_step_seconds=statistics.median(steady) if steady else None,
        compile_step_seconds=statistics.median(compiling) if compiling else None,
        torch=torch.__version__,
        pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
    )
    return out


def run_mode(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_") or k.endswith("CACHE_DIR")}
    env.update({"ACCELERATE_NEURON_SIMULATE": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    # Every mode is a first run: no persistent NEFF cache to find graphs of an earlier run in.
    env["TORCH_NEURONX_NEFF_DISABLE_CACHE"] = "1"
    env.update(MODES[name])
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _seconds(value: float | None) -> str:
    return "n/a (every step compiled)" if value is None else f"{value:.3f} s"


def report(spec: dict[str, Any], results: dict[str, dict[str, Any]], command: str) -> str:
    import accelerate
    import transformers

    what = "tiny Llama, Trainer + DataCollatorForLanguageModeling"
    if spec.get("scenario") == "trl-sft":
        import trl

        multiple = next((r.get("pad_to_multiple_of") for r in results.values() if "steps" in r), None)
        what = (
            f"tiny Llama + LoRA (r=8, q/v), TRL {trl.__version__} SFTTrainer and its own collator "
            f"(pad_to_multiple_of={multiple!r}, asked: {spec.get('trl_multiple')!r})"
        )
    lines = [
        f"Command: `{command}`",
        "",
        f"transformers {transformers.__version__}, accelerate {accelerate.__version__}; "
        f"{spec['samples']} samples of {spec['min_len']}-{spec['max_len']} tokens ({spec['dist']}, seed "
        f"{spec['seed']}), batch {spec['batch']}, 1 epoch, bf16={spec['bf16']}, {what}, simulated trn2 core.",
        "",
        "| run | device / backend | drop_last | steps | distinct batch shapes | Dynamo graphs | Neuron graphs "
        "| lengths compiled | recompile-limit hits | eager signatures | padding overhead | est. Trainium compile "
        "| epoch (CPU) | steady step (CPU) | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | not run: `TrainingArguments(...)` raises {r['error']} |" + " |" * 13)
            continue
        if "steps" not in r:
            lines.append(
                f"| {name} | {r['device']} / {r['backend']} | {r['drop_last']} | not run: upstream trains on the "
                f"{r['device']}, no graph reaches Neuron |" + " |" * 11
            )
            continue
        low, high = (r["neuron_graphs"] * s / 60 for s in NEFF_SECONDS)
        lens = r["lengths_compiled"]
        shown = ", ".join(map(str, lens)) if len(lens) <= 6 else f"{len(lens)} lengths ({lens[0]}..{lens[-1]})"
        lines.append(
            f"| {name} | {r['device']} / {r['backend']} | {r['drop_last']} | {r['steps']} | {r['batch_shapes']} "
            f"| {r['dynamo_graphs']} "
            f"| {r['neuron_graphs']} | {shown} | {r['recompile_limit_hits']} | {r['eager_signatures']} "
            f"| {r['padding_overhead']:.0%} | {low:.0f}-{high:.0f} min | {r['epoch_seconds']:.1f} s "
            f"| {_seconds(r['steady_step_seconds'])} | {r['loss']:.4f} |"
        )
    ran = {k: v for k, v in results.items() if "steps" in v}
    base = ran.get("upstream") or ran.get("buckets off")
    ours = ran.get("plugin")
    if base and ours:
        base_name = "upstream" if "upstream" in ran else "buckets off"
        lines += [
            "",
            f"Neuron graphs per epoch, plugin / {base_name}: {ours['neuron_graphs']} / {base['neuron_graphs']} "
            f"= {ours['neuron_graphs'] / max(base['neuron_graphs'], 1):.2f}.",
            f"Steady-state step time (CPU), plugin / {base_name}: "
            f"{_seconds(ours['steady_step_seconds'])} / {_seconds(base['steady_step_seconds'])}"
            + (
                f" = {ours['steady_step_seconds'] / base['steady_step_seconds']:.2f}."
                if ours["steady_step_seconds"] and base["steady_step_seconds"]
                else "."
            ),
            f"Epoch wall time (CPU, includes Dynamo/AOTAutograd tracing), plugin / {base_name}: "
            f"{ours['epoch_seconds'] / base['epoch_seconds']:.2f}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--dist", choices=("uniform", "lognormal"), default="uniform", help="sample lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scenario",
        choices=("trainer", "trl-sft"),
        default="trainer",
        help="trainer: Trainer + Transformers' collator; trl-sft: TRL's SFTTrainer with a LoRA peft_config",
    )
    parser.add_argument(
        "--trl-pad-to-multiple-of",
        default="auto",
        help="trl-sft: SFTConfig.pad_to_multiple_of (TRL 1.16's 'auto' is 128 on Neuron; 'none': each batch's longest)",
    )
    parser.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--output", type=Path, help="also write the markdown report here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(child(json.loads(ns.child))))
        return
    if not 1 <= ns.min_len <= ns.max_len:
        parser.error(f"--min-len {ns.min_len} / --max-len {ns.max_len}: need 1 <= min-len <= max-len")
    spec = {
        "samples": ns.samples,
        "batch": ns.batch,
        "min_len": ns.min_len,
        "max_len": ns.max_len,
        "seed": ns.seed,
        "dist": ns.dist,
        "bf16": not ns.fp32,
        "scenario": ns.scenario,
        "trl_multiple": ns.trl_pad_to_multiple_of,
    }
    results = {}
    for name in ns.modes:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run_mode(name, spec)
    command = "python benchmarks/training.py " + " ".join(sys.argv[1:])
    text = report(spec, results, command.strip())
    print(text)
    if ns.output:
        ns.output.write_text(text)


if __name__ == "__main__":
    main()
