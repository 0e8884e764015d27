"""``device_map`` placement on simulated Neuron cores: patched vs stock upstream, in one run.

For 1, 2 and 4 simulated cores (one child process each) and every strategy
(``auto``, ``balanced``, ``balanced_low_0``, ``sequential``) it loads the same
checkpoint with ``from_pretrained(..., device_map=strategy)`` twice per round,
with the placement patches applied and reverted (stock upstream), and reports:

- share of parameter bytes on Neuron cores;
- per-core balance: max / mean bytes over the visible cores (1.0 = even; N =
  everything on one of N cores);
- cores used, and bytes left on CPU/disk;
- load-time ratio patched / stock (median of ``--rounds``). Stock loads on the
  CPU, so this is the cost of copying to the device; the simulator's device
  memory is host memory, so the ratio says little about Trainium.

Two HBM sizes: the trn2 default (24 GiB per core: the model fits anywhere) and
a small one (``--small-hbm``) so that the model outgrows a core and spills or
offloads.

    python benchmarks/placement.py [--rounds 5] [--cores 1 2 4] [--small-hbm 12MB] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
MODEL = {"family": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8, "vocab_size": 4096}

CHILD = r"""
import contextlib, gc, json, os, statistics, sys, tempfile, time
import torch, transformers
from accelerate_neuron import activation, simulator, tiny

spec = json.loads(sys.argv[1])
rounds = int(sys.argv[2])
family = spec.pop("family")
vocab = spec.pop("vocab_size")
path = tempfile.mkdtemp()
tiny.model(family, vocab_size=vocab, **spec).save_pretrained(path)
cores = torch.neuron.device_count()

def load(strategy):
    gc.collect()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=strategy)
    seconds = time.perf_counter() - start
    per = {}
    for p in model.parameters():
        per[str(p.device)] = per.get(str(p.device), 0) + p.numel() * p.element_size()
    del model
    return seconds, per

def measure(strategy, patched):
    with contextlib.nullcontext() if patched else activation.unpatched():
        load(strategy)  # warm-up
        times, per = [], None
        for _ in range(rounds):
            seconds, per = load(strategy)
            times.append(seconds)
    total = sum(per.values())
    core_bytes = [per.get(f"neuron:{i}", 0) for i in range(cores)]
    on_neuron = sum(core_bytes)
    mean = on_neuron / cores
    return {
        "seconds": statistics.median(times),
        "share_on_neuron": on_neuron / total,
        "balance": (max(core_bytes) / mean) if on_neuron else None,
        "cores_used": sum(1 for b in core_bytes if b),
        "off_neuron_bytes": total - on_neuron,
        "model_bytes": total,
    }

out = {s: {"patched": measure(s, True), "stock": measure(s, False)} for s in json.loads(sys.argv[3])}
print(json.dumps({"cores": cores, "hbm": simulator.stats()["hbm_per_core"], "results": out}))
"""


def _child(cores: int, hbm: str, rounds: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_")}
    if "ACCELERATE_NEURON_CACHE_DIR" in os.environ:
        env["ACCELERATE_NEURON_CACHE_DIR"] = os.environ["ACCELERATE_NEURON_CACHE_DIR"]
    env.update(
        ACCELERATE_NEURON_SIMULATE=str(cores),
        ACCELERATE_NEURON_SIM_HBM=hbm,
        HF_HUB_OFFLINE="1",
        HF_DEACTIVATE_ASYNC_LOAD="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(MODEL), str(rounds), json.dumps(STRATEGIES)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child ({cores} cores, {hbm}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_balance(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(runs: list[tuple[str, dict]]) -> str:
    lines = [
        "| HBM/core | cores | strategy | on Neuron (patched / stock) | balance max/mean (patched) | cores used "
        "| left on CPU/disk (patched) | load time patched/stock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hbm, run in runs:
        for strategy, pair in run["results"].items():
            p, s = pair["patched"], pair["stock"]
            lines.append(
                f"| {hbm} | {run['cores']} | `{strategy}` | {p['share_on_neuron']:.0%} / {s['share_on_neuron']:.0%} "
                f"| {_fmt_balance(p['balance'])} | {p['cores_used']} | {p['off_neuron_bytes'] / 1e6:.2f} MB "
                f"| {p['seconds'] / s['seconds']:.2f}x ({p['seconds'] * 1e3:.0f} / {s['seconds'] * 1e3:.0f} ms) |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed loads per strategy and variant (default 5)")
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2, 4], help="simulated core counts")
    parser.add_argument("--small-hbm", default="12MB", help="HBM per core of the spill/offload runs (default 12MB)")
    parser.add_argument("--output", help="also write the markdown report to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if any(c < 1 for c in args.cores):
        parser.error(f"--cores must be positive, got {args.cores}")
    runs = []
    for hbm in ("24GiB", args.small_hbm):
        for cores in args.cores:
            runs.append((hbm, _child(cores, hbm, args.rounds)))
    model_mb = runs[0][1]["results"]["auto"]["patched"]["model_bytes"] / 1e6
    command = f"{sys.executable} benchmarks/placement.py " + " ".join(sys.argv[1:])
    layers, hidden, vocab = MODEL["num_hidden_layers"], MODEL["hidden_size"], MODEL["vocab_size"]
    model_line = (
        f"Model: tiny Llama, {layers} layers, hidden {hidden}, vocab {vocab}: {model_mb:.1f} MB of fp32 weights. "
        '"stock" = every accelerate-neuron patch reverted in the same process (what a Trainium user gets today).'
    )
    report = textwrap.dedent(
        f"""\
        # Benchmark: device_map placement on (simulated) Neuron cores

        Command: `{command.strip()}` (simulated device; {args.rounds} timed loads per cell, median)

        {model_line}

        """
    )
    report += _table(runs) + "\n"
    print(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
