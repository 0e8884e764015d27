"""One step, one graph: graphs per step of stock Hugging Face workloads on a simulated Neuron core, patched vs stock.

On Neuron every piece of a broken Dynamo graph is its own NEFF: its own compile, its own launch and a
device->host->device hop between pieces. Each workload runs in a child process on the simulated device, twice:

- ``stock``: accelerate-neuron as it was before issue 36: the ``tracing`` plugin disabled
  (``ACCELERATE_NEURON_DISABLE=tracing``), the paged cache's update left out of the serving step
  (patch ``serving.traced_cache_update`` reverted) and continuous batching's warm-up over the whole grid;
- ``patched``: the defaults.

Workloads (stock scripts, tiny models):

- ``sft``: TRL ``SFTTrainer`` + PEFT LoRA, bf16, ``torch_compile``, 12 steps, every batch padded to [8, 128]
  (TRL's defaults: gradient checkpointing, its fused LM head);
- ``trainer-gc``: a ``Trainer`` with ``gradient_checkpointing=True`` on a PEFT LoRA model with
  ``enable_input_require_grads()``, float32, 8 steps of one shape;
- ``sliding-<family>``: ``generate()`` on Mistral, Gemma 2, Gemma 3, gpt-oss: 3 prompt lengths in one bucket,
  6 new tokens each;
- ``serving``: continuous batching (``generate_batch``, default grid), 16 requests with upstream's warm-up,
  then 16 more;
- ``tp-fsdp`` (``--tp-fsdp``, 4 processes): ``DistributedConfig(tp_size=2, fsdp_size=2)`` + ``torchrun`` + a
  ``Trainer`` with ``torch_compile``, 3 steps; per rank (stock: upstream's FSDP2, patched: the traced FSDP);
- ``fsdp`` (``--tp-fsdp``, 2 processes): the same with ``DistributedConfig(fsdp_size=2)``.

Reported: Dynamo graphs, NEFFs (compiled + loaded from the NEFF cache), graphs per step (the graphs one call of
the compiled function launched, its backward included: the target is 1 per inference step, 2 per training step)
and the results' check (tokens equal the CPU's; the loss of patched vs stock).

    python benchmarks/graphs.py [--only sft,serving,...] [--tp-fsdp] [--output FILE] [--svg FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
WORDS = "the cat sat on a mat and then ran off to see the dog who was very happy".split()
SLIDING = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
WORKLOADS = ("sft", "trainer-gc", *(f"sliding-{f}" for f in SLIDING), "serving")
STOCK_ENV = {"ACCELERATE_NEURON_DISABLE": "tracing", "ACCELERATE_NEURON_SERVING_WARMUP_SHAPES": "all"}


# ------------------------------------------------------------------------------------------ children


def _counts() -> dict[str, Any]:
    from accelerate_neuron import simulator

    st = simulator.stats()
    return {
        "dynamo_graphs": st["dynamo_graphs"],
        "compiled": st["compiles"],
        "loaded": st["compile_cache_hits"],
        "graphs_per_step": max((g["graphs_per_step"] for g in st["steps"]), default=0),
        "step_shapes": len(st["steps"]),
        "breaks": sorted({f"{b['where'].rsplit('site-packages/', 1)[-1]}: {b['reason']}" for b in st["graph_breaks"]}),
    }


def _stock_serving() -> None:
    import transformers.generation.continuous_batching.cache  # noqa: F401  (the patch applies on this import)

    from accelerate_neuron import patching

    patching.revert("serving.traced_cache_update")


def child_sft() -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from accelerate_neuron import tiny

    rng = random.Random(3)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"prompt": text(rng.randint(1, 4)), "completion": text(rng.randint(3, 30))} for _ in range(8 * 12)]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=12,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            bf16=True,
            torch_compile=True,
            max_length=128,
            pad_to_multiple_of=128,
        )
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = SFTTrainer(
            model=tiny.model("llama"),
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tiny.tokenizer(),
            peft_config=lora,
        )
        loss = trainer.train().training_loss
    return {**_counts(), "check": f"loss {loss:.6f}"}


def child_trainer_gc() -> dict[str, Any]:
    import transformers
    from peft import LoraConfig, get_peft_model

    from accelerate_neuron import tiny

    model = get_peft_model(
        tiny.model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    model.enable_input_require_grads()
    rows = [[(7 * i + j) % 300 + 3 for j in range(32)] for i in range(32)]
    data = [{"input_ids": r, "attention_mask": [1] * len(r), "labels": r} for r in rows]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            max_steps=8,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            torch_compile=True,
            gradient_checkpointing=True,
        )
        loss = transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss
    return {**_counts(), "check": f"loss {loss:.6f}"}


def child_sliding(family: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accelerate_neuron import simulator, tiny

    extra = {"head_dim": 16} if family != "mistral" else {"sliding_window": 4096}
    if family.startswith("gemma"):
        extra["query_pre_attn_scalar"] = 16
    if family == "gpt_oss":
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    config = AutoConfig.for_model(
        family, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        **tiny.DECODER_SIZES, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = [list(range(5, 5 + n)) for n in (5, 9, 13)]

    def generate(ids: list[int]) -> list[int]:
        return model.generate(torch.tensor([ids], device=model.device), max_new_tokens=6, do_sample=False)[0].tolist()

    expected = [generate(p) for p in prompts]
    model.to("neuron")
    simulator.reset_stats()
    same = [generate(p) for p in prompts] == expected
    return {**_counts(), "check": "tokens = CPU" if same else "TOKENS DIFFER"}


def child_serving() -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from accelerate_neuron import simulator, tiny

    lengths = [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 60, 110]
    words = tiny.CORPUS.split()
    tok = tiny.tokenizer()

    def requests(offset: int) -> list[list[int]]:
        prompts = [" ".join(words[(offset + i + j) % len(words)] for j in range(n)) for i, n in enumerate(lengths)]
        return [tok(p)["input_ids"] for p in prompts]

    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
    reference = tiny.model("qwen3", initializer_range=0.3)
    model = tiny.model("qwen3", initializer_range=0.3).to("neuron")
    simulator.reset_stats()
    first = requests(0)
    out = model.generate_batch(first, generation_config=config)
    warm = _counts()
    model.generate_batch(requests(16), generation_config=config)
    after = _counts()
    expected = [
        reference.generate(torch.tensor([ids]), generation_config=config)[0, len(ids) :].tolist() for ids in first
    ]
    same = sorted(map(tuple, (r.generated_tokens for r in out.values()))) == sorted(map(tuple, expected))
    growth = after["compiled"] + after["loaded"] - warm["compiled"] - warm["loaded"]
    return {**warm, "growth": growth, "check": "tokens = CPU" if same else "TOKENS DIFFER"}


def run_child(name: str) -> dict[str, Any]:
    if os.environ.get("ACCELERATE_NEURON_DISABLE") == "tracing":
        _stock_serving()
    if name == "sft":
        return child_sft()
    if name == "trainer-gc":
        return child_trainer_gc()
    if name.startswith("sliding-"):
        return child_sliding(name.removeprefix("sliding-"))
    if name == "serving":
        return child_serving()
    raise SystemExit(f"unknown workload {name!r}")


# ------------------------------------------------------------------------------------------ TP x FSDP

TP_SCRIPT = """
import json, os, sys, torch, transformers
from accelerate_neuron import simulator
sizes = transformers.DistributedConfig(tp_size=int(sys.argv[3]), fsdp_size=int(sys.argv[4]))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], distributed_config=sizes)
class Data(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        ids = [(i * 7 + j) % 300 + 3 for j in range(32)]
        return {"input_ids": ids, "attention_mask": [1] * 32, "labels": ids}
args = transformers.TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=2, max_steps=3,
    report_to=[], save_strategy="no", logging_strategy="no", torch_compile=True, seed=0)
loss = transformers.Trainer(model=model, args=args, train_dataset=Data()).train().training_loss
st = simulator.stats()
row = {"rank": int(os.environ["RANK"]), "dynamo_graphs": st["dynamo_graphs"], "compiled": st["compiles"],
       "loaded": st["compile_cache_hits"], "graphs_per_step": max(g["graphs_per_step"] for g in st["steps"]),
       "step_shapes": len(st["steps"]), "check": f"loss {loss:.6f}",
       "breaks": sorted({b["where"].rsplit("site-packages/", 1)[-1] + ": " + b["reason"] for b in st["graph_breaks"]})}
print("RANK_ROW " + json.dumps(row), flush=True)
"""


def run_tp_fsdp(env: dict[str, str], tp: int, fsdp: int) -> dict[str, Any]:
    from accelerate_neuron import tiny

    ranks = tp * fsdp
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny.save_pretrained(Path(tmp) / "model", "qwen3", initializer_range=0.3)
        script = Path(tmp) / "tp_fsdp.py"
        script.write_text(TP_SCRIPT)
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", str(script), str(model_dir), tmp]
        proc = subprocess.run(
            [*cmd, str(tp), str(fsdp)],
            env={**env, "ACCELERATE_NEURON_SIMULATE": str(ranks), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        rows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RANK_ROW ")]
        if proc.returncode or len(rows) != ranks:
            raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    worst = max(rows, key=lambda r: r["compiled"] + r["loaded"])
    first = next(r for r in rows if r["rank"] == 0)
    return {**worst, "check": f"rank 0's {first['check']}; counts: the rank with most NEFFs"}


# ------------------------------------------------------------------------------------------ the parent


def measure(name: str, stock: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_DISABLE")}
    env["ACCELERATE_NEURON_SIMULATE"] = env.get("ACCELERATE_NEURON_SIMULATE", "2")
    with tempfile.TemporaryDirectory() as neff:
        env["TORCH_NEURONX_NEFF_CACHE_DIR"] = neff  # a cold NEFF cache per run
        if stock:
            env.update(STOCK_ENV)
        started = time.perf_counter()
        if name == "tp-fsdp":
            row = run_tp_fsdp(env, tp=2, fsdp=2)
        elif name == "fsdp":
            row = run_tp_fsdp(env, tp=1, fsdp=2)
        else:
            proc = subprocess.run([sys.executable, str(HERE), "--child", name], env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(f"{name} ({'stock' if stock else 'patched'}) failed:\n{proc.stderr[-4000:]}")
            row = json.loads(lines[-1])
    return {**row, "seconds": time.perf_counter() - started}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| workload | run | Dynamo graphs | NEFFs (compiled + loaded) | graphs per step | step shapes | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        for mode in ("stock", "patched"):
            r = runs[mode]
            growth = f"; next 16 requests: +{r['growth']}" if "growth" in r else ""
            lines.append(
                f"| {name} | {mode} | {r['dynamo_graphs']} | {r['compiled'] + r['loaded']} ({r['compiled']} + "
                f"{r['loaded']}){growth} | {r['graphs_per_step']} | {r['step_shapes']} | {r['check']} |"
            )
    return "\n".join(lines)


def breaks(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = []
    for name, runs in results.items():
        for mode in ("stock", "patched"):
            found = runs[mode].get("breaks") or []
            if found:
                lines.append(f"- {name}, {mode}: " + "; ".join(f"`{b}`" for b in found[:6]))
    return "\n".join(lines)


def svg(results: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    stock = [results[n]["stock"]["graphs_per_step"] for n in names]
    patched = [results[n]["patched"]["graphs_per_step"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], stock, width=0.4, label="stock")
    ax.bar([x + 0.2 for x in xs], patched, width=0.4, label="patched")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("graphs per step")
    ax.set_title("Graphs one step launches (each a NEFF launch and a host round trip)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="svg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated workloads among " + ", ".join(WORKLOADS))
    parser.add_argument(
        "--tp-fsdp", action="store_true", help="also run TP=2 x FSDP=2 (4 processes) and FSDP=2 (2) under torchrun"
    )
    parser.add_argument("--output", help="write the markdown table to this file")
    parser.add_argument("--svg", help="draw graphs per step, stock vs patched, to this SVG file")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child)), flush=True)
        return
    names = args.only.split(",") if args.only else list(WORKLOADS)
    if args.tp_fsdp:
        names += ["tp-fsdp", "fsdp"]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        results[name] = {mode: measure(name, mode == "stock") for mode in ("stock", "patched")}
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    import transformers

    text = f"Transformers {transformers.__version__}\n\n{table(results)}\n\nBreaks met:\n\n{breaks(results)}\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    if args.svg:
        svg(results, args.svg)


if __name__ == "__main__":
    main()
