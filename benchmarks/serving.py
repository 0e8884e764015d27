"""Continuous batching on (simulated) Neuron: patched vs stock upstream, in one run.

The workload is a server's: ``--requests`` requests (default 64) submitted to
``model.init_continuous_batching()`` (what ``transformers serve
--continuous-batching`` drives) in ``--waves`` waves (default 2), each wave
after the previous one finished, so the second wave shows what a warm server
pays. Prompt lengths are long-tailed: lognormal, median 48 tokens, sigma 1.0,
clipped to 4-448; each request's ``max_new_tokens`` is drawn from 8 (40%), 16
(30%), 32 (20%) and 64 (10%); greedy; a tiny Qwen3 (2 layers, vocabulary 512,
2,048-token context), seeded.

Scenarios, each on a fresh model with Dynamo reset and a cold (memory-only) NEFF cache:

- ``patched``: accelerate-neuron as installed, default settings (query buckets
  16 ... 512, KV buckets 512 ... 16,384, a 16,384-token cache), upstream's
  default warm-up (the whole grid on Neuron) before the first wave;
- ``patched, fewer buckets``: the same with query buckets 16, 64, 256, 512 and
  KV buckets 2,048, 8,192, 16,384 (the graphs-versus-padding trade-off);
- ``patched, fit``: query and KV buckets ``fit`` (``ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS=fit``,
  ``ACCELERATE_NEURON_SERVING_KV_BUCKETS=fit``), fitted to the step sizes an earlier run of the same server
  recorded (``--requests`` other requests from seed ``--seed`` + 100, served without a warm-up into a scratch
  NEFF cache folder, as yesterday's traffic would have), then the same warm-up and waves as ``patched``;
- ``stock``: every accelerate-neuron patch reverted, with the same cache size
  and token budget as ``patched`` (stock sizes the cache from the host's memory
  on Neuron: upstream's memory probe knows CUDA, XPU and MPS only).

Per scenario and wave: graphs compiled and eager signatures (what Neuron
compiles), the cost model's compile time on Trainium, padding overhead (query
tokens computed per real query token, KV tokens read per real KV token, at the
compiled step's door), steps, and CPU wall time (the simulator's, not
Trainium's). The tokens of every request are checked equal across scenarios.

``--only sampling`` (issue 42): four requests with their own temperature and top_p in one batch
(``per_request_processors=True``, the model's config samples with top_k=50), vocabulary ``--vocab``
(default 32,000), one query bucket (32) and one KV bucket (1,024): patched, patched with
``ACCELERATE_NEURON_DEVICE_SAMPLING=0`` (upstream's sort and multinomial in the compiled step) and stock
(every patch reverted: upstream's eager step): device->host bytes per step, graphs and eager signatures after
the warm-up, the most distinct temperatures one step sampled.

    python benchmarks/serving.py [--requests 64] [--waves 2] [--seed 0] [--output FILE]
    python benchmarks/serving.py --only sampling [--vocab 32000] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import model_runner

import accelerate_neuron
from _common import emit, environment
from accelerate_neuron import activation, simulator, tiny
from accelerate_neuron.builtin.serving import plan as serving_plan
from accelerate_neuron.builtin.shapes import record
from accelerate_neuron.costs import describe, estimate
from accelerate_neuron.simulator import neff_cache

NEW_TOKENS = ((8, 0.4), (16, 0.3), (32, 0.2), (64, 0.1))
FEWER = {
    serving_plan.TOKEN_BUCKETS_ENV: "16,64,256,512",
    serving_plan.KV_BUCKETS_ENV: "2048,8192",
}
FIT = {serving_plan.TOKEN_BUCKETS_ENV: "fit", serving_plan.KV_BUCKETS_ENV: "fit"}
WARMUP_ENV = "ACCELERATE_NEURON_SERVING_WARMUP_SHAPES"
CONTEXT = 2048


def workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) of each request."""
    rng = random.Random(seed)
    vocab = range(3, 512)  # no pad / bos / eos inside a prompt
    requests = []
    for _ in range(count):
        length = min(448, max(4, round(rng.lognormvariate(mu=3.87, sigma=1.0))))  # e^3.87 ~ 48 tokens
        new = rng.choices([n for n, _ in NEW_TOKENS], weights=[w for _, w in NEW_TOKENS])[0]
        requests.append(([rng.choice(vocab) for _ in range(length)], new))
    return requests


class Steps:
    """Real and padded sizes of every step, read where the compiled step starts."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int]] = []  # (real q, padded q, real kv, padded kv)
        self.original = model_runner.ModelRunner.compute_batch

    def __enter__(self) -> Steps:
        record, original = self.rows, self.original

        def compute_batch(runner, model, batch_data):
            io = runner.inputs_and_outputs
            padded_q = int(batch_data["input_ids"].shape[-1])
            padded_kv = int(batch_data["read_index"][0].numel()) if batch_data["read_index"] else 0
            real_kv = int(io.true_read_sizes[0]) if io.max_kv_read else int(io.total_seqlen_q)
            record.append((int(io.total_seqlen_q), padded_q, real_kv, max(padded_kv, padded_q)))
            return original(runner, model, batch_data)

        model_runner.ModelRunner.compute_batch = compute_batch
        return self

    def __exit__(self, *exc: object) -> None:
        model_runner.ModelRunner.compute_batch = self.original

    def overhead(self, start: int) -> tuple[float, float, int]:
        rows = self.rows[start:]
        real_q, pad_q = sum(r[0] for r in rows), sum(r[1] for r in rows)
        real_kv, pad_kv = sum(r[2] for r in rows), sum(r[3] for r in rows)
        return pad_q / max(real_q, 1), pad_kv / max(real_kv, 1), len(rows)


def serve(model, requests, waves: int, cb: ContinuousBatchingConfig | None) -> tuple[list, list[dict]]:
    """Every request's tokens, and per wave (the first includes the warm-up) what it cost."""
    config = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=0)
    simulator.reset_stats()
    tokens, rows, before = [], [], simulator.stats()
    with Steps() as steps:
        started = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        manager.warmup()
        manager.start()
        try:
            size = -(-len(requests) // waves)
            for wave in range(waves):
                first_step = len(steps.rows)
                ids = [manager.add_request(p, max_new_tokens=n) for p, n in requests[wave * size : (wave + 1) * size]]
                done = {}
                while len(done) < len(ids):
                    out = manager.get_result(timeout=600)
                    if out is None:
                        raise RuntimeError("the continuous batching worker stopped answering")
                    if out.is_finished():
                        if out.error is not None:
                            raise RuntimeError(out.error)
                        done[out.request_id] = out.generated_tokens
                tokens += [done[i] for i in ids]
                st = simulator.stats()
                q, kv, count = steps.overhead(first_step)
                graphs = st["compiles"] - before["compiles"]
                eager = st["eager_signatures"] - before["eager_signatures"]
                rows.append(
                    {
                        "graphs": graphs,
                        "eager": eager,
                        "estimate": estimate(graphs, eager),
                        "q_overhead": q,
                        "kv_overhead": kv,
                        "steps": count,
                        "seconds": time.perf_counter() - started,
                    }
                )
                before, started = st, time.perf_counter()
        finally:
            manager.stop(block=True, timeout=60)
            manager.destroy()
    return tokens, rows


def fresh_model():
    torch._dynamo.reset()
    neff_cache.use(None)  # a cold, memory-only cache: each scenario counts what it compiles
    return tiny.model("qwen3", initializer_range=0.3, max_position_embeddings=CONTEXT).to("neuron")


def grid(plan: serving_plan.ServingPlan) -> str:
    kv = plan.kv_grid(plan.kv_cache_tokens)
    return f"query buckets {', '.join(map(str, plan.token_buckets))} x KV buckets {', '.join(map(str, kv))}"


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


#: (temperature, top_p) of each request of the sampling section, and its one-bucket grid.
SAMPLING_REQUESTS = [(0.3, 0.5), (1.4, 0.95), (0.9, 0.8), (1.1, 0.99)]
SAMPLING_GRID = {
    serving_plan.TOKEN_BUCKETS_ENV: "32",
    serving_plan.KV_BUCKETS_ENV: "1024",
    "ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS": "1024",
}
DEVICE_SAMPLING_ENV = "ACCELERATE_NEURON_DEVICE_SAMPLING"


def sample_batch(vocab: int, cb: ContinuousBatchingConfig, new_tokens: int = 16) -> dict:
    """One batch of sampling requests with their own settings, after the warm-up: what each step cost."""
    tok = tiny.tokenizer()
    words = tiny.CORPUS.split()
    prompts = [tok(" ".join(words[3 * i : 3 * i + 5]))["input_ids"] for i in range(len(SAMPLING_REQUESTS))]
    torch._dynamo.reset()
    neff_cache.use(None)
    model = tiny.model("qwen3", initializer_range=0.3, max_position_embeddings=CONTEXT, vocab_size=vocab).to("neuron")
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=True, temperature=0.7, top_k=50, top_p=0.9, eos_token_id=2, pad_token_id=0
    )
    temperatures: list[int] = []
    original = model_runner.ModelRunner.compute_batch

    def compute_batch(runner, model, batch_data):
        args = batch_data.get("logits_processor_args")
        values = set(args.cpu().view(torch.float32).flatten().tolist()) if args is not None else set()
        temperatures.append(len(values & {torch.tensor(t).item() for t, _ in SAMPLING_REQUESTS}))
        return original(runner, model, batch_data)

    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.warmup()
    simulator.reset_stats()
    model_runner.ModelRunner.compute_batch = compute_batch
    torch.manual_seed(0)
    try:
        ids = [
            manager.add_request(p, max_new_tokens=new_tokens, temperature=t, top_p=p_)
            for p, (t, p_) in zip(prompts, SAMPLING_REQUESTS, strict=True)
        ]
        manager.start()
        done = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("the continuous batching worker stopped answering")
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(out.error)
                done[out.request_id] = out.generated_tokens
    finally:
        model_runner.ModelRunner.compute_batch = original
        manager.stop(block=True, timeout=60)
        manager.destroy()
    st = simulator.stats()
    steps = len(temperatures)
    return {
        "steps": steps,
        "tokens": sum(len(t) for t in done.values()),
        "d2h_step": st["d2h_bytes"] / steps,
        "h2d_step": st["h2d_bytes"] / steps,
        "graphs": st["compiles"],
        "eager": st["eager_signatures"],
        "mixed": max(temperatures),
    }


def sampling_section(args) -> list[str]:
    """Continuous batching with per-request sampling settings in one batch: patched, upstream's, stock."""
    cb = ContinuousBatchingConfig(per_request_processors=True)
    results = []
    with environment(SAMPLING_GRID):
        results.append(
            ("patched (warpers without a sort, draw from the device's random numbers)", sample_batch(args.vocab, cb))
        )
        with environment({DEVICE_SAMPLING_ENV: "0"}):
            results.append(
                (f"patched, {DEVICE_SAMPLING_ENV}=0 (upstream's sort and multinomial)", sample_batch(args.vocab, cb))
            )
        # Stock gets the patched run's cache size and token budget (it would size the cache from host memory).
        stock_cb = ContinuousBatchingConfig(
            per_request_processors=True, num_blocks=1024 // cb.page_size, max_batch_tokens=32
        )
        with activation.unpatched():
            results.append(("stock (upstream's eager step)", sample_batch(args.vocab, stock_cb)))
    lines = [
        f"### Sampling, Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, "
        f"accelerate-neuron {accelerate_neuron.__version__})",
        "",
        f"Command: `python benchmarks/serving.py --only sampling --vocab {args.vocab}`. Tiny Qwen3, vocab "
        f"{args.vocab}; the model's config samples (temperature 0.7, top_k 50, top_p 0.9); "
        f"{len(SAMPLING_REQUESTS)} requests of 16 new tokens each with their own (temperature, top_p): "
        f"{'; '.join(f'{t}, {p}' for t, p in SAMPLING_REQUESTS)}, submitted together; query bucket 32, KV bucket "
        "1,024. Figures after the warm-up; a float32 logits row is "
        f"{4 * args.vocab:,} bytes.",
        "",
        "| scenario | steps | tokens | d2h B/step | h2d B/step | graphs compiled | eager signatures | most "
        "requests' temperatures in one step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results:
        lines.append(
            f"| {name} | {r['steps']} | {r['tokens']} | {r['d2h_step']:,.0f} | {r['h2d_step']:,.0f} | {r['graphs']} "
            f"| {r['eager']} | {r['mixed']} |"
        )
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("sampling",), help="run one section only")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of the sampling section's model")
    parser.add_argument("--output", help="append the markdown section to this file")
    args = parser.parse_args()
    if args.only == "sampling":
        text = "\n".join(sampling_section(args))
        emit(text, args.output)
        return
    requests = workload(args.requests, args.seed)

    model = fresh_model()
    patched_tokens, patched = serve(model, requests, args.waves, None)
    resolved = serving_plan.resolve(model.config.get_text_config(), model.device)
    with environment(FEWER):
        model = fresh_model()
        fewer_tokens, fewer = serve(model, requests, args.waves, None)
        coarse = serving_plan.resolve(model.config.get_text_config(), model.device)
    with (
        tempfile.TemporaryDirectory(prefix="serving-records-") as folder,
        environment({"TORCH_NEURONX_NEFF_CACHE_DIR": folder}),
    ):
        record.reset()
        with environment({WARMUP_ENV: "0"}):  # the earlier run: its step sizes recorded, no grid compiled
            serve(fresh_model(), workload(args.requests, args.seed + 100), args.waves, None)
        record.flush()
        record.reset()  # a new run: fit reads the record
        with environment(FIT):
            model = fresh_model()
            fit_tokens, fitted = serve(model, requests, args.waves, None)
            fit_plan = serving_plan.resolve(model.config.get_text_config(), model.device)
        record.reset()
    # Stock gets the patched run's cache size and token budget (it would size the cache from host memory).
    blocks = -(-resolved.kv_cache_tokens // ContinuousBatchingConfig().page_size)
    stock_cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=resolved.token_buckets[-1])
    model = fresh_model()
    with activation.unpatched():
        stock_tokens, stock = serve(model, requests, args.waves, stock_cb)
    mismatches = sum(
        any(other != b for other in others)
        for b, *others in zip(stock_tokens, patched_tokens, fewer_tokens, fit_tokens, strict=True)
    )

    lengths = sorted(len(p) for p, _ in requests)
    news = [n for _, n in requests]
    lines = [
        f"### Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, accelerate-neuron "
        f"{accelerate_neuron.__version__})",
        "",
        f"Command: `python benchmarks/serving.py --requests {args.requests} --waves {args.waves} --seed {args.seed}`. "
        f"{args.requests} requests in {args.waves} waves; prompt tokens: median {lengths[len(lengths) // 2]}, "
        f"90th percentile {lengths[int(0.9 * (len(lengths) - 1))]}, max {lengths[-1]}; max_new_tokens "
        f"8/16/32/64: {', '.join(str(news.count(n)) for n, _ in NEW_TOKENS)} requests. Patched: "
        f"{grid(resolved)}; fewer buckets: {grid(coarse)}; fit: {grid(fit_plan)}. "
        f"Requests whose tokens differ between the scenarios: {mismatches} of {len(requests)}.",
        "",
        "| scenario | wave | graphs compiled | eager signatures | est. Trainium compile | query tokens computed / "
        "real | KV tokens read / real | steps | CPU wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    scenarios = (("patched", patched), ("patched, fewer buckets", fewer), ("patched, fit", fitted), ("stock", stock))
    for name, rows in scenarios:
        for wave, row in enumerate(rows, 1):
            label = f"{wave}" + (" (with warm-up)" if wave == 1 and name != "stock" else "")
            lines.append(
                f"| {name} | {label} | {row['graphs']} | {row['eager']} | {minutes(row['estimate']['seconds'])} | "
                f"{row['q_overhead']:.2f} | {row['kv_overhead']:.2f} | {row['steps']} | {row['seconds']:.1f} s |"
            )
    lines += ["", f"Cost model: {describe(patched[0]['estimate'])} (wave 1 of patched), see accelerate_neuron.costs."]
    text = "\n".join(lines)
    emit(text, args.output)
    if mismatches:
        sys.exit(f"{mismatches} request(s) differ between patched and stock")


if __name__ == "__main__":
    main()
