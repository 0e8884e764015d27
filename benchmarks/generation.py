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

The workload section is a job the defaults were not tuned for: ``--passes``
(default 4) passes of ``--prompts`` prompts (default 48), one after the other
in one process on one (initially cold) NEFF cache, whose token lengths are
drawn from a lognormal distribution (median 64 tokens, sigma 1.0, clipped to
8-1,024), grouped into batches of mixed sizes (1, 2, 3, 4, 6 or 8 prompts,
uniformly drawn, left padded), ``max_new_tokens=16``, greedy, on a tiny Qwen3
with a 2,048-token context. Patched (prompt and batch buckets, compiled
prefill) against the seed's stock recipe (``cache_implementation="static"``,
inputs on the host where the release allows it, else on the device), and a
model split over two cores with and without buckets: compiled graphs and eager
signatures each pass compiles, the cost model's compile time on Trainium,
padding overhead (positions computed / real positions) and CPU wall time.
Every result is checked against the stock one.

``--only speculation`` runs assisted generation (a draft model) and prompt lookup over 8 prompt lengths one by one,
patched and stock: graphs, eager signatures and their growth per prompt length, target forwards per token.

``--only sampling``: ``do_sample=True, top_k=50, top_p=0.9, temperature=0.7`` (issue 42) at one and four rows,
patched (sampling on the device), patched with ``ACCELERATE_NEURON_DEVICE_SAMPLING=0`` (the host path) and stock
with a static cache: device->host bytes per step, graphs (the sampling step's among them), eager signatures; then
the graphs of 8 prompt lengths and of 6 parameter values.

``--only moe`` runs that job on the dense tiny Qwen3 and on a tiny Qwen3-MoE of the same sizes (4 experts,
top-2), patched and stock, in one table: what routing adds to graphs, eager signatures and host round trips.

    python benchmarks/generation.py [--tokens 8 16 32] [--vocab 32000] [--prompts 48] [--passes 4]
                                    [--seed 0] [--only workload|steps|regions|moe|speculation|sampling]
                                    [--output FILE] [--plot docs/speculation.svg]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "2")  # the workload's split model uses the second core
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

import accelerate_neuron
from _common import emit, left_padded
from accelerate_neuron import activation, hookimpl, plugins, simulator, tiny
from accelerate_neuron import costs as _costs
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.generation import cache as gcache
from accelerate_neuron.builtin.generation import devices as gdev
from accelerate_neuron.costs import estimate
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


WORKLOAD_CONTEXT = 2048
WORKLOAD_NEW_TOKENS = 16
BATCH_CHOICES = (1, 2, 3, 4, 6, 8)
WORKLOAD_MAX_PROMPT = 1024
REGIONS_ENV = "ACCELERATE_NEURON_COMPILE_REGIONS"


def workload_batches(prompts: int, seed: int, vocab: int) -> list[list[list[int]]]:
    """Batches of token-id prompts: lognormal lengths (median 64, sigma 1, 8-1,024), mixed batch sizes."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.empty(prompts).log_normal_(mean=4.1589, std=1.0, generator=gen)
    lengths = lengths.round().clamp(8, WORKLOAD_MAX_PROMPT).long()
    ids = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    batches, i = [], 0
    while i < len(ids):
        size = BATCH_CHOICES[int(torch.randint(len(BATCH_CHOICES), (1,), generator=gen))]
        batches.append(ids[i : i + size])
        i += size
    return batches


def _run_workload(model, batches, stock: bool, fresh: bool = True) -> dict:
    simulator.reset_stats()  # settles the eager ops seen so far into the cache they ran on
    if fresh:  # a new process on a cold NEFF cache: nothing compiled yet
        torch._dynamo.reset()
        neff_cache.use(None)
        simulator.reset_stats()
    host_inputs = stock and not transformers.__version__.startswith("4.")  # 4.x refuses host inputs
    outputs = []
    start = time.perf_counter()
    for batch in batches:
        enc = left_padded(batch)
        if not host_inputs:
            enc = {k: v.to(model.device) for k, v in enc.items()}
        kwargs = {"cache_implementation": "static"} if stock else {}
        out = model.generate(**enc, max_new_tokens=WORKLOAD_NEW_TOKENS, do_sample=False, **kwargs)
        outputs.append(out.cpu())
    seconds = time.perf_counter() - start
    stats = simulator.stats()
    return {"stats": stats, "seconds": seconds, "outputs": outputs, "host_inputs": host_inputs}


def _workload_model(vocab: int, layers: int = 2, family: str = "qwen3"):
    return tiny.model(
        family,
        vocab_size=vocab,
        initializer_range=0.3,
        max_position_embeddings=WORKLOAD_CONTEXT,
        num_hidden_layers=layers,
    )


def _split_model(vocab: int, layers: int = 2):
    """The workload's model dispatched over two cores: the first half of its layers on core 0, the rest on 1."""
    from accelerate import dispatch_model

    device_map = {"model.embed_tokens": 0, "lm_head": 0, "model.rotary_emb": 0, "model.norm": 1}
    device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)})
    return dispatch_model(_workload_model(vocab, layers), device_map)


def _positions(batches, policy, bucket_rows: bool, bucket_columns: bool) -> int:
    """Positions run through the model: the prefill's (rows x prompt columns) plus one per row per decode step."""
    steps = WORKLOAD_NEW_TOKENS - 1
    total = 0
    for b in batches:
        width = max(map(len, b))  # upstream pads a batch to its longest prompt
        columns = (policy.prompt_bucket(width) or width) if bucket_columns else width
        rows = (policy.batch_bucket(len(b)) or len(b)) if bucket_rows else len(b)
        total += rows * (columns + steps)
    return total


def _reachable_graphs(policy) -> int:
    """Upper bound of the patched job's graphs: (prompt bucket, batch bucket) prefills + (cache, batch) decodes."""
    prompts = [bk for bk in policy.prompt_buckets if bk <= policy.prompt_bucket(WORKLOAD_MAX_PROMPT)]
    rows = [bk for bk in policy.batch_buckets if bk <= policy.batch_bucket(max(BATCH_CHOICES))]
    caches = {max(64, 1 << (bk + WORKLOAD_NEW_TOKENS - 1).bit_length()) for bk in prompts}  # pow2 cache buckets
    return len(rows) * (len(prompts) + len(caches))


def _agreement(runs: dict, reference: list[dict], passes: list, vocab: int, family: str = "qwen3") -> str:
    """Whether every setting generated stock's tokens; where not, how close the reference's choice was.

    Padding changes the shapes of the float32 reductions (a masked position adds an exact 0, but the kernel
    may sum in another order), so a near-tie between two tokens can flip. Each first differing token is
    re-scored on the CPU from the unpadded prefix: a gap of a few 1e-6 between the two tokens' logits is
    rounding, a large one would be a bug.
    """
    cpu = _workload_model(vocab, family=family)
    rows = differing = 0
    gaps: list[float] = []
    where: list[str] = []
    for name, job_runs in runs.items():
        for run, ref, batches in zip(job_runs, reference, passes, strict=True):
            for out, expected, batch in zip(run["outputs"], ref["outputs"], batches, strict=True):
                width = max(map(len, batch))
                for row, prompt in enumerate(batch):
                    rows += 1
                    got, want = out[row], expected[row]
                    if torch.equal(got, want):
                        continue
                    differing += 1
                    first = int((got != want).nonzero()[0])
                    if first < width or got.shape != want.shape:  # the prompt or the shape differs: no tie
                        gaps.append(float("inf"))
                        where.append(f"{name}: {len(prompt)}-token prompt, prompt columns or shape differ")
                        continue
                    prefix = want[width - len(prompt) : first].unsqueeze(0)
                    with torch.no_grad():
                        logits = cpu(input_ids=prefix).logits[0, -1]
                    gaps.append(float((logits[want[first]] - logits[got[first]]).abs()))
                    best = int(logits.argmax())
                    side = "stock" if best == int(want[first]) else name if best == int(got[first]) else "neither"
                    where.append(f"{name}: {len(prompt)}-token prompt, new token {first - width}, CPU picks {side}'s")
    if not differing:
        return f"Every setting's tokens identical to stock's ({rows} sequences)."
    return (
        f"Tokens identical to stock's in {rows - differing} of {rows} sequences; in the other {differing} the "
        f"first differing token was a near-tie (the two tokens' logits, re-scored on the CPU in float32, differ "
        f"by at most {max(gaps):.1e}; float32 rounding of differently shaped reductions)."
        if max(gaps) < 1e-3
        else f"Tokens differ from stock's in {differing} of {rows} sequences, with logit gaps up to "
        f"{max(gaps):.2g} at the first difference: NOT a rounding tie, investigate ({'; '.join(where)})."
    )


def workload_section(args) -> list[str]:
    # One job that goes on: pass k is --prompts new prompts (seed + k) in the same process, on the same cache.
    passes = [workload_batches(args.prompts, args.seed + k, args.vocab) for k in range(args.passes)]
    model = _workload_model(args.vocab).to("neuron")
    split = _split_model(args.vocab)

    def job(target, stock: bool) -> list[dict]:
        return [_run_workload(target, batches, stock=stock, fresh=k == 0) for k, batches in enumerate(passes)]

    runs = {"accelerate-neuron": job(model, stock=False)}
    with activation.unpatched():
        runs["stock + static"] = job(model, stock=True)
    os.environ[REGIONS_ENV] = "off"  # these rows are the eager split model (regions: see --only regions)
    try:
        runs["accelerate-neuron, model split over 2 cores (eager, prompt buckets only)"] = job(split, stock=False)
        os.environ[shapes.PROMPT_BUCKETS_ENV] = os.environ[shapes.BATCH_BUCKETS_ENV] = "off"
        runs["accelerate-neuron, model split over 2 cores, buckets off"] = job(split, stock=False)
    finally:
        for name in (REGIONS_ENV, shapes.PROMPT_BUCKETS_ENV, shapes.BATCH_BUCKETS_ENV):
            os.environ.pop(name, None)
    reference = runs["stock + static"]
    agreement = _agreement(runs, reference, passes, args.vocab)
    policy = shapes.resolve_policy(WORKLOAD_CONTEXT)
    everything = [b for batches in passes for b in batches]
    real = sum(len(p) + WORKLOAD_NEW_TOKENS - 1 for b in everything for p in b)
    positions = {
        "accelerate-neuron": _positions(everything, policy, bucket_rows=True, bucket_columns=True),
        "stock + static": _positions(everything, policy, bucket_rows=False, bucket_columns=False),
    }
    positions[next(k for k in runs if "prompt buckets only" in k)] = _positions(
        everything, policy, bucket_rows=False, bucket_columns=True
    )
    positions[next(k for k in runs if "buckets off" in k)] = positions["stock + static"]
    rows = []
    for name, job_runs in runs.items():
        graphs = [r["stats"]["compiles"] for r in job_runs]  # NEFF cache misses: what this pass compiled
        eager = [r["stats"]["eager_compiles"] for r in job_runs]
        per_pass = [estimate(g, e)["seconds"] / 60 for g, e in zip(graphs, eager, strict=True)]
        total = estimate(sum(graphs), sum(eager))
        rows.append(
            f"| {name} | {' + '.join(map(str, graphs))} = {sum(graphs)} | {' + '.join(map(str, eager))} = "
            f"{sum(eager)} | {' + '.join(f'{m:.0f}' for m in per_pass)} = {total['seconds'] / 60:.0f} min | "
            f"{positions[name] / real:.2f} | {sum(r['seconds'] for r in job_runs):.0f} s |"
        )
    lengths = sorted(len(p) for b in everything for p in b)
    calls = [len(batches) for batches in passes]
    return [
        f"Workload: {args.passes} passes of {args.prompts} prompts each (seeds {args.seed}-"
        f"{args.seed + args.passes - 1}), one after the other in the same process: {len(lengths)} prompts in "
        f"{sum(calls)} generate() calls. Prompt "
        f"lengths lognormal (median 64, sigma 1, clipped to 8-1,024): min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]} tokens, {len(set(lengths))} distinct; batch sizes drawn "
        f"uniformly from {', '.join(map(str, BATCH_CHOICES))} (left padded); max_new_tokens={WORKLOAD_NEW_TOKENS}, "
        f"greedy; tiny Qwen3 with a {WORKLOAD_CONTEXT}-token context, vocab {args.vocab}. The NEFF cache starts "
        "cold and is kept between passes (one long job); each cell gives pass 1 + pass 2 + ... Stock inputs on the "
        f"{'host' if reference[0]['host_inputs'] else 'device (4.x refuses host inputs)'}. {agreement} "
        "Patched graphs can never exceed "
        f"{_reachable_graphs(policy)} for this distribution (prefills per reachable (prompt bucket, "
        "batch bucket), decodes per (cache bucket, batch bucket)); stock has no bound but Dynamo's recompile limit "
        "(8 per frame), after which it runs the decode step eagerly. Cost model: "
        f"{_costs.SECONDS_PER_GRAPH:.0f} s per graph, {_costs.SECONDS_PER_EAGER_SIGNATURE:.0f} s per eager signature "
        "(it prices every graph alike; a 1,024-token prefill graph compiles longer than a decode step).",
        "",
        "| setting | compiled graphs, per pass | eager signatures compiled, per pass | est. compile on Trainium "
        "(cost model), per pass | positions computed per real position (padding) | CPU wall (simulator) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def regions_section(args) -> list[str]:
    """The varied-prompt job on one core and split over two, with and without compiled regions, against stock.

    Each row is one job on its own cold NEFF cache (fresh Dynamo): compiled graphs (NEFF cache misses), graphs
    loaded from the NEFF cache (a layer graph another layer compiled), eager signatures compiled, the cost
    model's compile time, CPU wall time. The 4-layer split row shows what depth costs.
    """
    passes = [workload_batches(args.prompts, args.seed + k, args.vocab) for k in range(args.passes)]

    def job(target, stock: bool = False, regions: str | None = None) -> list[dict]:
        if regions is not None:
            os.environ[REGIONS_ENV] = regions
        try:
            return [_run_workload(target, batches, stock=stock, fresh=k == 0) for k, batches in enumerate(passes)]
        finally:
            os.environ.pop(REGIONS_ENV, None)

    one = _workload_model(args.vocab).to("neuron")
    split = _split_model(args.vocab)
    runs = {}
    with activation.unpatched():
        runs["stock + static, 1 core"] = job(one, stock=True)
        runs["stock + static, split over 2 cores"] = job(split, stock=True)
    runs["accelerate-neuron, 1 core (auto: whole model)"] = job(one)
    runs["accelerate-neuron, 1 core, regions=layers"] = job(one, regions="layers")
    runs["accelerate-neuron, split over 2 cores, regions off (eager)"] = job(split, regions="off")
    runs["accelerate-neuron, split over 2 cores (auto: layers)"] = job(split)
    deep = _split_model(args.vocab, layers=4)
    runs["accelerate-neuron, 4 layers split over 2 cores (auto: layers)"] = job(deep)
    reference = runs["stock + static, 1 core"]
    same_weights = {k: v for k, v in runs.items() if not k.startswith("accelerate-neuron, 4 layers")}
    agreement = _agreement(same_weights, reference, passes, args.vocab)
    rows = []
    for name, job_runs in runs.items():
        graphs = [r["stats"]["compiles"] for r in job_runs]
        loads = sum(r["stats"]["compile_cache_hits"] for r in job_runs)
        eager = [r["stats"]["eager_compiles"] for r in job_runs]
        total = estimate(sum(graphs), sum(eager))
        rows.append(
            f"| {name} | {' + '.join(map(str, graphs))} = {sum(graphs)} | {loads} | "
            f"{' + '.join(map(str, eager))} = {sum(eager)} | {total['seconds'] / 60:.0f} min | "
            f"{sum(r['seconds'] for r in job_runs):.0f} s |"
        )
    everything = [b for batches in passes for b in batches]
    lengths = sorted(len(p) for b in everything for p in b)
    return [
        f"Regional compilation on the varied-prompt job: {args.passes} passes of {args.prompts} prompts (seeds "
        f"{args.seed}-{args.seed + args.passes - 1}, one job on one NEFF cache, cold at the start), prompt lengths "
        f"lognormal (median 64, sigma 1, clipped to 8-1,024; min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}), batch sizes drawn from {', '.join(map(str, BATCH_CHOICES))}, "
        f"max_new_tokens={WORKLOAD_NEW_TOKENS}, greedy, tiny Qwen3 (2 layers unless noted, vocab {args.vocab}). "
        "The split model has half its layers on each core (embeddings and head on core 0, final norm on core 1). "
        f"{agreement} (The 4-layer model has other weights: it is compared with nothing, it shows graph counts.)",
        "",
        "| setting | compiled graphs, per pass | graphs loaded from the NEFF cache | eager signatures compiled, per "
        "pass | est. compile on Trainium (cost model) | CPU wall (simulator) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def moe_section(args) -> list[str]:
    """The varied-prompt job on a dense model and on a mixture-of-experts model of the same sizes, patched and stock.

    The MoE model is a tiny Qwen3-MoE (4 experts, top-2, expert width 64) with the dense Qwen3's hidden size,
    layers, vocabulary and context: the rows show what routing adds to a job's graphs and eager signatures.
    """
    passes = [workload_batches(args.prompts, args.seed + k, args.vocab) for k in range(args.passes)]
    rows, notes = [], []
    for family, label in (("qwen3", "Qwen3 (dense)"), ("qwen3_moe", "Qwen3-MoE (4 experts, top-2)")):
        model = _workload_model(args.vocab, family=family).to("neuron")
        runs = {
            f"accelerate-neuron, {label}": [
                _run_workload(model, batches, stock=False, fresh=k == 0) for k, batches in enumerate(passes)
            ]
        }
        del model
        with activation.unpatched():  # built stock too: a model built patched names the plugin's experts
            model = _workload_model(args.vocab, family=family).to("neuron")
            runs[f"stock + static, {label}"] = [
                _run_workload(model, batches, stock=True, fresh=k == 0) for k, batches in enumerate(passes)
            ]
        notes.append(f"{label}: {_agreement(runs, runs[f'stock + static, {label}'], passes, args.vocab, family)}")
        for name, job_runs in runs.items():
            graphs = [r["stats"]["compiles"] for r in job_runs]
            eager = [r["stats"]["eager_compiles"] for r in job_runs]
            fallbacks = sum(r["stats"]["cpu_fallbacks"] for r in job_runs)
            total = estimate(sum(graphs), sum(eager))
            rows.append(
                f"| {name} | {' + '.join(map(str, graphs))} = {sum(graphs)} | {' + '.join(map(str, eager))} = "
                f"{sum(eager)} | {total['seconds'] / 60:.0f} min | {fallbacks} | "
                f"{sum(r['seconds'] for r in job_runs):.0f} s |"
            )
        del model
    everything = [b for batches in passes for b in batches]
    lengths = sorted(len(p) for b in everything for p in b)
    return [
        f"Mixture of experts beside dense on the varied-prompt job: {args.passes} passes of {args.prompts} prompts "
        f"(seeds {args.seed}-{args.seed + args.passes - 1}, one job on one NEFF cache, cold at the start), prompt "
        f"lengths lognormal (median 64, sigma 1, clipped to 8-1,024; min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}), batch sizes drawn from "
        f"{', '.join(map(str, BATCH_CHOICES))}, max_new_tokens={WORKLOAD_NEW_TOKENS}, greedy, vocab {args.vocab}, "
        f"{WORKLOAD_CONTEXT}-token context, 2 layers, hidden 64, one core. Stock rows revert every patch and pass "
        "`cache_implementation=\"static\"` (the seed's recipe); stock MoE runs upstream's experts, whose "
        "per-expert token counts (an integer `histc`) run on the host on Neuron (CPU fallbacks column). "
        + " ".join(notes),
        "",
        "| setting | compiled graphs, per pass | eager signatures compiled, per pass | est. compile on Trainium "
        "(cost model) | CPU fallbacks run | CPU wall (simulator) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


SPECULATION_WORDS = [3, 7, 11, 15, 19, 23, 27, 31]
SPECULATION_NEW_TOKENS = 16
SPECULATION_CANDIDATES = 4


def _speculation_models(vocab: int):
    """The target (tiny Qwen3, 2 layers) and its draft: the same weights nudged (10% of each tensor's spread), so
    it agrees with the target on most candidates but not all; 1 layer would agree on none (random weights)."""
    target = tiny.model("qwen3", vocab_size=vocab, initializer_range=0.3)
    draft = tiny.model("qwen3", vocab_size=vocab, initializer_range=0.3)
    draft.load_state_dict(target.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1 * p.std())
    draft.generation_config.num_assistant_tokens = SPECULATION_CANDIDATES
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return target.to("neuron"), draft.to("neuron")


def _run_speculation(vocab: int, mode: str, stock: bool) -> dict:
    torch._dynamo.reset()
    neff_cache.use(None)
    target, draft = _speculation_models(vocab)
    tok = tiny.tokenizer()
    words = tiny.CORPUS.split()
    kwargs = {"assistant_model": draft} if mode == "assisted" else {"prompt_lookup_num_tokens": SPECULATION_CANDIDATES}
    accelerate_neuron.reset_speculation_stats()
    simulator.reset_stats()
    # Stock's target forwards, counted at the module (the plugin runs the model's forward on a runner and counts
    # its own: speculation_stats()).
    forwards: list[int] = []
    handle = target.register_forward_hook(lambda *a: forwards.append(1)) if stock else None
    growth, outputs, tokens, start = [], [], 0, time.perf_counter()
    for n in SPECULATION_WORDS:
        text = " ".join(words[i % len(words)] for i in range(n))
        enc = tok(f"{text} {text}" if mode == "lookup" else text, return_tensors="pt")
        before = simulator.stats()["eager_compiles"]
        out = target.generate(
            **{k: v.to("neuron") for k, v in enc.items()},
            do_sample=False,
            max_new_tokens=SPECULATION_NEW_TOKENS,
            **kwargs,
        )
        growth.append(simulator.stats()["eager_compiles"] - before)
        outputs.append(out.cpu())
        tokens += out.shape[1] - enc["input_ids"].shape[1]
    seconds = time.perf_counter() - start
    if handle is not None:
        handle.remove()
    spec = accelerate_neuron.speculation_stats()
    return {
        "forwards_per_token": spec["forwards_per_token"] if spec["calls"] else len(forwards) / tokens,
        "stats": simulator.stats(),
        "growth": growth,
        "outputs": outputs,
        "speculation": spec,
        "seconds": seconds,
    }


def plot_speculation(path: str, curves: dict[str, list[int]]) -> None:
    """Eager signatures compiled, cumulative, prompt length after prompt length: one line per setting (SVG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for name, growth in curves.items():
        total, points = 0, []
        for added in growth:
            total += added
            points.append(total)
        axis.plot(range(1, len(points) + 1), points, marker="o", label=name)
    axis.set_yscale("symlog", linthresh=10)
    axis.set_xlabel("prompt lengths run (one by one)")
    axis.set_ylabel("eager signatures compiled (total)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title("Speculative decoding on Neuron (benchmarks/generation.py --only speculation)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})
    print(f"wrote {path}", file=sys.stderr)


def speculation_section(args) -> list[str]:
    """Assisted generation and prompt lookup over 8 prompt lengths one by one, patched and stock."""
    rows, notes, curves = [], [], {}
    for mode, label in (("assisted", "assisted (draft model)"), ("lookup", "prompt lookup")):
        patched = _run_speculation(args.vocab, mode, stock=False)
        with activation.unpatched():
            stock = _run_speculation(args.vocab, mode, stock=True)
        same = all(torch.equal(a, b) for a, b in zip(patched["outputs"], stock["outputs"], strict=True))
        notes.append(f"{label}: tokens {'identical' if same else 'DIFFERENT'} patched vs stock")
        for name, run in ((f"accelerate-neuron, {label}", patched), (f"stock, {label}", stock)):
            curves[name] = run["growth"]
            st = run["stats"]
            est = estimate(st["compiles"], st["eager_compiles"])
            per_token = f"{run['forwards_per_token']:.2f}"
            rows.append(
                f"| {name} | {st['compiles']} | {st['eager_compiles']} | {' / '.join(map(str, run['growth']))} | "
                f"{per_token} | {est['seconds'] / 60:.0f} min | {run['seconds']:.0f} s |"
            )
    if args.plot:
        plot_speculation(args.plot, curves)
    return [
        f"Speculative decoding: {len(SPECULATION_WORDS)} prompts of different lengths one by one (words "
        f"{', '.join(map(str, SPECULATION_WORDS))}; prompt lookup: each prompt twice over), greedy, "
        f"max_new_tokens={SPECULATION_NEW_TOKENS}, tiny Qwen3 target (2 layers, hidden 64, vocab {args.vocab}); the "
        f"draft is the target's weights nudged by 10% of each tensor's spread, {SPECULATION_CANDIDATES} candidates "
        f"(constant schedule); prompt lookup proposes up to {SPECULATION_CANDIDATES}. Target forwards per token are "
        "the plugin's count (`accelerate_neuron.speculation_stats()`), stock's a forward hook on the target; the "
        "decode time on Trainium follows them "
        "(decode is memory-bound: a target forward over 1 + k tokens costs about one token's). "
        + "; ".join(notes)
        + ".",
        "",
        "| setting | compiled graphs | eager signatures | eager signatures added per prompt length | target forwards "
        "per token | est. compile on Trainium (cost model) | CPU wall (simulator) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


#: The issue's sampling settings (issue 42), and the parameter values the graph must not depend on.
SAMPLING = {"do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.7}
SAMPLING_VALUES = [(0.3, 0.5, 10), (1.0, 0.95, 200), (1.6, 0.7, 3), (0.9, 0.99, 256), (0.7, 0.8, 64), (1.2, 0.9, 1)]
SAMPLING_WORDS = [2, 5, 9, 14, 20, 27, 35, 44]
DEVICE_SAMPLING_ENV = "ACCELERATE_NEURON_DEVICE_SAMPLING"


def _sampling_run(model, enc, tokens: list[int], **kwargs) -> dict:
    """Per-step figures of a sampling generate(): the warm-up compiles, then two lengths (same seed)."""
    simulator.reset_stats()
    model.generate(**enc, max_new_tokens=2, **SAMPLING, **kwargs)
    warm = simulator.stats()
    sampling_graphs = sum(1 for g in warm["graphs"] if (g.get("frame") or {}).get("function") == "sampling_step")
    rows = {}
    for n in tokens:
        simulator.reset_stats()
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=n, **SAMPLING, **kwargs)
        stats = simulator.stats()
        rows[n] = {"stats": stats, "new": out.shape[1] - enc["input_ids"].shape[1]}
    lo, hi = rows[tokens[0]], rows[tokens[-1]]
    steps = hi["new"] - lo["new"]
    return {
        "signatures": [rows[n]["stats"]["eager_signatures"] for n in tokens],
        "compiles": warm["compiles"] + sum(r["stats"]["compiles"] for r in rows.values()),
        "sampling_graphs": sampling_graphs,
        "h2d_step": (hi["stats"]["h2d_bytes"] - lo["stats"]["h2d_bytes"]) / steps,
        "d2h_step": (hi["stats"]["d2h_bytes"] - lo["stats"]["d2h_bytes"]) / steps,
    }


def sampling_section(args) -> list[str]:
    """do_sample=True, top_k=50, top_p=0.9, temperature=0.7: bytes per step, graphs, eager signatures."""
    tok = tiny.tokenizer()
    tokens = [8, 16]
    scenarios: list[tuple[str, int, dict]] = []

    def scenario(name: str, rows: int, stock: bool = False, host_inputs: bool = False, **kwargs) -> None:
        model = _fresh(args.vocab)
        host = tok(
            [PROMPT, "hello world , this is a tiny", "the core", "compiled graph runs"][:rows],
            padding=True,
            return_tensors="pt",
        )
        enc = host if host_inputs else {k: v.to(model.device) for k, v in host.items()}
        try:
            result = _sampling_run(model, enc, tokens, **kwargs)
        except Exception as exc:  # stock 4.x with host inputs: device mismatch
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"}
        scenarios.append((name, rows, result))
        print(name, rows, result, file=sys.stderr, flush=True)

    for rows in (1, 4):
        scenario("patched (sampling on the device)", rows)
        os.environ[DEVICE_SAMPLING_ENV] = "0"
        try:
            scenario(f"patched, {DEVICE_SAMPLING_ENV}=0 (host path)", rows)
        finally:
            del os.environ[DEVICE_SAMPLING_ENV]
        with activation.unpatched():
            host_inputs = not transformers.__version__.startswith("4.")
            where = "host" if host_inputs else "device"
            scenario(
                f"stock + static, inputs on the {where}", rows, host_inputs=host_inputs, cache_implementation="static"
            )

    # Graphs across prompt lengths, then across parameter values (a fresh model, one row).
    model = _fresh(args.vocab)
    simulator.reset_stats()
    for words in SAMPLING_WORDS:
        enc = {k: v.to("neuron") for k, v in tok([" ".join(["core"] * words)], return_tensors="pt").items()}
        model.generate(**enc, max_new_tokens=4, **SAMPLING)
    lengths = simulator.stats()
    length_sampling = sum(1 for g in lengths["graphs"] if (g.get("frame") or {}).get("function") == "sampling_step")
    simulator.reset_stats()
    for temperature, top_p, top_k in SAMPLING_VALUES:
        model.generate(**enc, max_new_tokens=4, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    values = simulator.stats()

    lines = [
        "### Sampling on the device",
        "",
        f"Model: tiny Qwen3 (2 layers, hidden 64), vocab {args.vocab}; `do_sample=True, top_k=50, top_p=0.9, "
        "temperature=0.7`; inputs `.to(model.device)` unless noted. Bytes per step are the difference between the "
        f"{tokens[-1]}- and {tokens[0]}-token runs (same seed) over the extra steps; graphs include the warm-up call.",
        "",
        "| scenario | rows | d2h B/step | h2d B/step | compiled graphs (of which sampling) | eager signatures at "
        + "/".join(map(str, tokens))
        + " new tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows, r in scenarios:
        if "error" in r:
            lines.append(f"| {name} | {rows} | fails: `{r['error']}` | | | |")
            continue
        lines.append(
            f"| {name} | {rows} | {r['d2h_step']:,.0f} | {r['h2d_step']:,.0f} | {r['compiles']} "
            f"({r['sampling_graphs']}) | {'/'.join(map(str, r['signatures']))} |"
        )
    lines += [
        "",
        f"Patched, one row: {len(SAMPLING_WORDS)} prompt lengths ({', '.join(map(str, SAMPLING_WORDS))} words) "
        f"compile {lengths['compiles']} graphs, {length_sampling} of them the sampling step; then "
        f"{len(SAMPLING_VALUES)} (temperature, top_p, top_k) values "
        f"({'; '.join(f'{t}, {p}, {k}' for t, p, k in SAMPLING_VALUES)}) compile {values['compiles']} graphs and "
        f"{values['eager_compiles']} eager ops (NEFF cache misses).",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=48, help="prompts in the workload section")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and batch sizes")
    parser.add_argument("--passes", type=int, default=4, help="workload passes of --prompts new prompts each")
    parser.add_argument(
        "--only",
        choices=("workload", "steps", "regions", "moe", "speculation", "sampling"),
        help="run one section only",
    )
    parser.add_argument("--output", help="append the markdown section to this file")
    parser.add_argument("--plot", metavar="SVG", help="with --only speculation: draw the eager-signature trend")
    args = parser.parse_args()
    tokens = sorted(args.tokens)
    header = [
        f"## Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, "
        f"accelerate-neuron {accelerate_neuron.__version__})",
        "",
        f"Command: `{sys.executable} benchmarks/generation.py {' '.join(sys.argv[1:])}` (simulated device, 1 core)",
        "",
    ]
    if args.only == "workload":
        emit("\n".join([*header, *workload_section(args)]), args.output)
        return
    if args.only == "moe":
        emit("\n".join([*header, *moe_section(args)]), args.output)
        return
    if args.only == "speculation":
        emit("\n".join([*header, *speculation_section(args)]), args.output)
        return
    if args.only == "sampling":
        emit("\n".join([*header, *sampling_section(args)]), args.output)
        return
    if args.only == "regions":
        header[2] = header[2].replace("1 core", "2 cores")
        emit("\n".join([*header, *regions_section(args)]), args.output)
        return

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
        *header,
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
    if args.only != "steps":
        lines += workload_section(args)
    emit("\n".join(lines), args.output)


if __name__ == "__main__":
    main()
