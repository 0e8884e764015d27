"""``generate()`` on (simulated) Neuron: patched vs stock upstream, in one run.

The stock script: a causal LM on a NeuronCore, ``inputs = tokenizer(...).to(model.device)``,
``model.generate(**inputs, max_new_tokens=N)`` (greedy). Scenarios, each on a fresh
model with Dynamo reset and a cold (memory-only) NEFF cache:

- ``patched``: accelerate-neuron as installed (static cache by default, buckets,
  compiled decode, ids on the host, greedy token picked on the device);
- ``patched, logits to host``: the same, with a plugin answering ``"cpu"`` for
  ``"logits"`` (upstream's full-row copy every step), to price the greedy pick;
- ``stock``: every accelerate-neuron patch reverted (what a Trainium user gets
  today), default cache;
- ``stock + static``: stock, ``cache_implementation="static"``;
- ``stock + static, host inputs``: stock, static cache, inputs left on the CPU
  (Transformers >= 5.20's own answer; 4.x fails with a device mismatch).

Per scenario: eager signatures for each ``max_new_tokens`` and their slope per
token, compiled graphs, host->device / device->host bytes per decode step
(difference between the longest and shortest run over the extra steps), and
the time spent in accelerate-neuron's per-step code (moving forward inputs,
picking the greedy token) as a share of the decode step. The simulator runs a
step far slower than a NeuronCore, so that share is a lower bound; the
microseconds per step are reported too.

A second table counts compiled graphs across 10 different ``max_new_tokens``
(each run stopped after 2 tokens: the cache is sized by ``max_new_tokens``).

    python benchmarks/generation.py [--tokens 8 16 32] [--vocab 32000] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

import accelerate_neuron
from accelerate_neuron import activation, hookimpl, plugins, simulator, tiny
from accelerate_neuron.builtin.generation import cache as gcache
from accelerate_neuron.builtin.generation import devices as gdev
from accelerate_neuron.simulator import neff_cache

PROMPT = "the neuron core runs the compiled graph"
BUCKET_LENGTHS = [3, 7, 12, 20, 28, 35, 44, 52, 61, 70]


class _Timer:
    """Accumulated seconds inside accelerate-neuron's per-step functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"move": 0.0, "select_greedy": 0.0}
        self._depth = 0
        self._originals: dict[str, object] = {}

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            if self._depth:  # `move` recurses through its module global: time the outer call only
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self._depth -= 1

        return timed

    def __enter__(self) -> _Timer:
        # Both are looked up as module globals at call time by the per-step wrappers.
        for name in ("move", "select_greedy"):
            self._originals[name] = getattr(gdev, name)
            setattr(gdev, name, self._timed(name, self._originals[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._originals.items():
            setattr(gdev, name, fn)


class _HostLogits:
    @hookimpl
    def neuron_generation_tensor_device(self, name, model_device):
        return "cpu"


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full(
            (input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool, device=input_ids.device
        )


def _fresh(vocab: int):
    torch._dynamo.reset()
    # A cold, memory-only NEFF cache too: each scenario counts what it compiles, not what an earlier one left.
    neff_cache.use(None)
    return tiny.model("qwen3", vocab_size=vocab, initializer_range=0.3).to("neuron")


def _run(model, enc, tokens: list[int], **kwargs) -> dict:
    simulator.reset_stats()
    model.generate(**enc, max_new_tokens=2, do_sample=False, **kwargs)  # warm-up: graphs, cache
    warm = simulator.stats()["compiles"]
    rows = {}
    for n in tokens:
        simulator.reset_stats()
        with _Timer() as timer:
            start = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=n, do_sample=False, **kwargs)
            seconds = time.perf_counter() - start
        stats = simulator.stats()
        new = out.shape[1] - enc["input_ids"].shape[1]
        rows[n] = {
            "signatures": stats["eager_signatures"],
            "compiles": stats["compiles"],
            "h2d": stats["h2d_bytes"],
            "d2h": stats["d2h_bytes"],
            "seconds": seconds,
            "move": timer.seconds["move"],
            "pick": timer.seconds["select_greedy"],
            "new": new,
        }
    lo, hi = rows[tokens[0]], rows[tokens[-1]]
    steps = hi["new"] - lo["new"]
    return {
        "signatures": [rows[n]["signatures"] for n in tokens],
        "slope": (hi["signatures"] - lo["signatures"]) / steps,
        "compiles": warm + sum(r["compiles"] for r in rows.values()),
        "h2d_step": (hi["h2d"] - lo["h2d"]) / steps,
        "d2h_step": (hi["d2h"] - lo["d2h"]) / steps,
        "step_ms": (hi["seconds"] - lo["seconds"]) / steps * 1e3,
        "move_us": (hi["move"] - lo["move"]) / steps * 1e6,
        "pick_us": (hi["pick"] - lo["pick"]) / steps * 1e6,
    }


def _graphs_across_lengths(vocab: int, enc: dict, **kwargs) -> int:
    model = _fresh(vocab)
    stop = StoppingCriteriaList([_StopAfter(enc["input_ids"].shape[1] + 2)])
    simulator.reset_stats()
    for n in BUCKET_LENGTHS:
        model.generate(**enc, max_new_tokens=n, do_sample=False, stopping_criteria=stop, **kwargs)
    return simulator.stats()["compiles"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--output", help="append the markdown section to this file")
    args = parser.parse_args()
    tokens = sorted(args.tokens)

    tok = tiny.tokenizer()
    host = tok([PROMPT], return_tensors="pt")

    def on_device(model):
        return {k: v.to(model.device) for k, v in host.items()}

    scenarios = []

    def scenario(name: str, build, **kwargs) -> None:
        model = _fresh(args.vocab)
        enc = host if build == "host" else on_device(model)
        try:
            result = _run(model, enc, tokens, **kwargs)
        except Exception as exc:  # stock 4.x with host inputs: device mismatch
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"}
        scenarios.append((name, result))
        print(name, result, file=sys.stderr, flush=True)

    scenario("patched", "device")
    with plugins.registered(_HostLogits(), "bench-host-logits"):
        scenario("patched, logits to host", "device")
    with activation.unpatched():
        scenario("stock", "device")
        scenario("stock + static", "device", cache_implementation="static")
        scenario("stock + static, host inputs", "host", cache_implementation="static")

    enc = {k: v.to("neuron") for k, v in host.items()}
    graphs = {"patched (pow2 buckets)": _graphs_across_lengths(args.vocab, enc)}
    os.environ[gcache.BUCKETS_ENV] = "off"
    try:
        graphs["patched, buckets off"] = _graphs_across_lengths(args.vocab, enc)
    finally:
        del os.environ[gcache.BUCKETS_ENV]
    with activation.unpatched():
        graphs["stock + static"] = _graphs_across_lengths(args.vocab, enc, cache_implementation="static")

    lines = [
        f"## Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, "
        f"accelerate-neuron {accelerate_neuron.__version__})",
        "",
        f"Command: `{sys.executable} benchmarks/generation.py {' '.join(sys.argv[1:])}` (simulated device, 1 core)",
        "",
        f"Model: tiny Qwen3 (2 layers, hidden 64), vocab {args.vocab}; prompt of {host['input_ids'].shape[1]} "
        "tokens; greedy; inputs `.to(model.device)` unless noted. Bytes and time per step are the difference "
        f"between the {tokens[-1]}- and {tokens[0]}-token runs over the extra steps.",
        "",
        "| scenario | eager signatures at max_new_tokens "
        + "/".join(map(str, tokens))
        + " | slope per token | compiled graphs | h2d B/step | d2h B/step | step ms | plugin us/step: input moves"
        " + greedy pick | plugin share of step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in scenarios:
        if "error" in r:
            lines.append(f"| {name} | fails: `{r['error']}` | | | | | | | |")
            continue
        patched = not name.startswith("stock")
        hook = f"{r['move_us']:.0f} + {r['pick_us']:.0f}" if patched else "-"
        share = (r["move_us"] + r["pick_us"]) / (r["step_ms"] * 1e3) if r["step_ms"] > 0 else 0.0
        lines.append(
            f"| {name} | {'/'.join(map(str, r['signatures']))} | {r['slope']:.2f} | {r['compiles']} | "
            f"{r['h2d_step']:.0f} | {r['d2h_step']:.0f} | {r['step_ms']:.0f} | {hook} | "
            f"{f'{share:.1%}' if patched else '-'} |"
        )
    lines += [
        "",
        f"Compiled graphs across {len(BUCKET_LENGTHS)} generate() calls with max_new_tokens "
        f"{', '.join(map(str, BUCKET_LENGTHS))}:",
        "",
        "| setting | compiled graphs |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in graphs.items()],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
