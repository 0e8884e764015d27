"""Sampling on the device: logits processors and the draw in a compiled graph, one token id per row to the host.

On fixed logits, the device's processed scores and warped distribution are upstream's (Transformers'
own processor objects, applied on the host) to float32 rounding, on both ways of warping (the 256
candidates, the whole vocabulary); the draws follow the distribution (a chi-square test, fixed seed);
``generate()`` sends one id per row per step, reproduces under a seed, equals greedy with ``top_k=1``,
compiles one sampling graph for every prompt length and parameter value; continuous batching samples
requests with different temperatures in its compiled step. The device's random numbers are not the
CPU's, so sampled tokens are compared with themselves (seeds), never with the CPU's; greedy ones are
the CPU's.
"""

# ruff: noqa: F811 - the fixtures imported from test_generation are parameters of the tests below

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers.generation import logits_process as lp

from accelerate_neuron import simulator, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.generation import cache as gcache
from accelerate_neuron.builtin.generation import sampling as gsampling
from accelerate_neuron.builtin.sampling import ops, step
from accelerate_neuron.builtin.sampling import program as sprogram
from helpers import fresh_neff_cache_dir, serve_under_simulate
from test_generation import QWEN, _clean_dynamo, model, on, reference, tok  # noqa: F401 - shared fixtures

WORDS = tiny.CORPUS.split()
VOCAB = 1000  # above the 256 candidates, so both ways of warping are exercised
#: The issue's sampling settings.
SAMPLE = {"do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.7}


def prompt(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def fixed_logits(rows: int = 3, vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((rows, vocab), generator=gen) * 3
    ids = torch.randint(3, 40, (rows, 14), generator=gen)  # a small id range: repeats for the penalties and n-grams
    return logits, ids


def on_device(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("neuron") for k, v in tensors.items()}


def device_translation(processors, ids, vocab=VOCAB, greedy=False, candidates=256, max_length=40):
    return sprogram.translate(
        processors, sprogram.Context(vocab, ids), greedy=greedy, candidates=candidates, max_length=max_length
    )


# --- the device's arithmetic is upstream's, on fixed logits ------------------------------------------


WARPER_CASES = {
    # case: (processors, the way the device warps)
    "temperature, top_k 50, top_p 0.9 (the issue's)": (
        [lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(50), lp.TopPLogitsWarper(0.9)],
        "candidates",
    ),
    "top_k 256, the bound": ([lp.TopKLogitsWarper(256), lp.TopPLogitsWarper(0.99)], "candidates"),
    "top_k 40, min_p 0.1": ([lp.TopKLogitsWarper(40), lp.MinPLogitsWarper(0.1)], "candidates"),
    "top_p 0.9 alone (no top_k)": ([lp.TopPLogitsWarper(0.9)], "vocabulary"),
    "top_k 257, above the bound, top_p 0.95": (
        [lp.TemperatureLogitsWarper(1.3), lp.TopKLogitsWarper(257), lp.TopPLogitsWarper(0.95)],
        "vocabulary",
    ),
    "top_k 600 alone": ([lp.TopKLogitsWarper(600)], "vocabulary"),
    "temperature, min_p 0.05": ([lp.TemperatureLogitsWarper(0.8), lp.MinPLogitsWarper(0.05)], "vocabulary"),
    "plain multinomial": ([], "vocabulary"),
}


@pytest.mark.parametrize("case", list(WARPER_CASES))
def test_warped_distribution_equals_the_hosts(case):
    processors, way = WARPER_CASES[case]
    logits, ids = fixed_logits()
    host = lp.LogitsProcessorList(processors)(ids.clone(), logits.clone()).softmax(dim=-1)
    t = device_translation(processors, ids)
    assert t.program.path == way
    device = step.distribution(t.program, logits.to("neuron"), on_device(t.params), on_device(t.state)).cpu()
    assert torch.equal(device > 0, host > 0), case  # the same tokens kept
    torch.testing.assert_close(device, host, rtol=0, atol=1e-6)


def test_top_p_alone_is_exact_where_the_anchors_would_truncate():
    """A flat row: the nucleus of top_p=0.9 holds ~900 tokens, far more than 256 candidates would."""
    logits = torch.randn((2, VOCAB), generator=torch.Generator().manual_seed(3)) * 0.05
    ids = torch.zeros((2, 1), dtype=torch.long)
    processors = [lp.TopPLogitsWarper(0.9)]
    host = lp.LogitsProcessorList(processors)(ids, logits.clone()).softmax(dim=-1)
    t = device_translation(processors, ids)
    device = step.distribution(t.program, logits.to("neuron"), on_device(t.params), on_device(t.state)).cpu()
    assert (host > 0).sum(dim=-1).min() > 800
    assert torch.equal(device > 0, host > 0)
    torch.testing.assert_close(device, host, rtol=0, atol=1e-6)


def _stage_cases(ids: torch.Tensor) -> dict[str, list]:
    last = int(ids[0, -1])
    return {
        "repetition_penalty": [lp.RepetitionPenaltyLogitsProcessor(1.3)],
        "repetition_penalty, prompt_ignore_length": [lp.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=6)],
        "no_repeat_ngram_size 2": [lp.NoRepeatNGramLogitsProcessor(2)],
        "no_repeat_ngram_size 3": [lp.NoRepeatNGramLogitsProcessor(3)],
        "bad_words_ids (one and several tokens)": [lp.NoBadWordsLogitsProcessor([[5], [last, 7], [3, 4, 9]], 2)],
        "sequence_bias": [lp.SequenceBiasLogitsProcessor([[[last, 11], 4.0], [[12], -2.5], [[8, 9, 10], 1.5]])],
        "min_length": [lp.MinLengthLogitsProcessor(16, 2)],
        "min_new_tokens": [lp.MinNewTokensLengthLogitsProcessor(14, 2, [2, 3])],
        "suppress_tokens": [lp.SuppressTokensLogitsProcessor([11, 12, 5000])],
        "begin_suppress_tokens": [lp.SuppressTokensAtBeginLogitsProcessor([2, 13], 15)],
        "forced_eos_token_id": [lp.ForcedEOSTokenLogitsProcessor(17, 2)],
        "remove_invalid_values, then penalties": [
            lp.InfNanRemoveLogitsProcessor(),
            lp.RepetitionPenaltyLogitsProcessor(0.7),
            lp.NoRepeatNGramLogitsProcessor(2),
        ],
    }


@pytest.mark.parametrize("case", list(_stage_cases(torch.full((1, 1), 3))))
def test_full_vocabulary_processors_equal_the_hosts_step_after_step(case):
    """Each processor's scores, then again after three tokens were appended (the state the device carries)."""
    logits, ids = fixed_logits()
    processors = _stage_cases(ids)[case]
    if case.startswith("remove_invalid"):
        logits[0, 3], logits[1, 4], logits[2, 5] = float("nan"), float("inf"), float("-inf")
    t = device_translation(processors, ids)
    program, params, state = t.program, on_device(t.params), on_device(t.state)
    assert program.stages and program.path == "vocabulary"
    for appended in ([], [4], [7], [9]):  # lengths 14 to 17: every step-dependent processor switches
        for token in appended:  # the device's state moves on with the token; the host's ids grow by it
            state = step.advance(state, torch.full((ids.shape[0],), token, device="neuron"))
            ids = torch.cat([ids, torch.full((ids.shape[0], 1), token)], dim=1)
        host = lp.LogitsProcessorList(processors)(ids.clone(), logits.clone())
        device = step.processed(program, logits.to("neuron"), params, state).cpu()
        assert torch.equal(torch.isneginf(device), torch.isneginf(host)), (case, ids.shape[1])
        torch.testing.assert_close(device, host, rtol=0, atol=0, equal_nan=True, msg=f"{case}, {ids.shape[1]}")


def test_greedy_with_processors_picks_the_hosts_argmax():
    logits, ids = fixed_logits()
    processors = [lp.RepetitionPenaltyLogitsProcessor(1.3), lp.SuppressTokensLogitsProcessor([0, 1])]
    t = device_translation(processors, ids, greedy=True)
    chosen, _ = step.compiled(t.program)(logits.to("neuron"), on_device(t.params), on_device(t.state))
    assert chosen.cpu().tolist() == lp.LogitsProcessorList(processors)(ids, logits.clone()).argmax(-1).tolist()


@pytest.mark.one_pair
@pytest.mark.parametrize("way", ["candidates", "vocabulary"])
def test_draws_follow_the_distribution(way):
    """Chi-square of 10,000 draws (fixed seed: the same draws every run) against the warped distribution.

    The rarest kept token has probability 1.6% (155 expected draws): enough for the test."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] + [-30.0] * 292])
    cut = lp.TopKLogitsWarper(7) if way == "candidates" else lp.TopPLogitsWarper(0.97)
    processors = [lp.TemperatureLogitsWarper(0.9), cut]
    rows = 2000
    t = device_translation(processors, torch.zeros((rows, 1), dtype=torch.long), vocab=300, candidates=8)
    assert t.program.path == way
    expected = lp.LogitsProcessorList(processors)(torch.zeros((1, 1), dtype=torch.long), logits.clone()).softmax(-1)
    sample = step.compiled(t.program)
    params, state = on_device(t.params), on_device(t.state)
    torch.manual_seed(1234)
    counts = torch.zeros(300)
    for _ in range(5):
        chosen, _ = sample(logits.expand(rows, -1).contiguous().to("neuron"), params, state)
        counts += torch.bincount(chosen.cpu(), minlength=300).float()
    kept = expected[0] > 1e-4
    assert counts[~kept].sum() <= 2  # the -30 logits (probability ~1e-14) and the token top-k drops: never
    n = counts.sum()
    observed, wanted = counts[kept], expected[0, kept] * n
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, dof, observed.tolist(), wanted.tolist())


def test_the_top_k_bound_decides_the_way_and_is_a_setting(monkeypatch):
    _, ids = fixed_logits()

    def way(processors, vocab=VOCAB, candidates=256):
        return device_translation(processors, ids, vocab=vocab, candidates=candidates).program.path

    assert way([lp.TopKLogitsWarper(256), lp.TopPLogitsWarper(0.9)]) == "candidates"
    assert way([lp.TopKLogitsWarper(257), lp.TopPLogitsWarper(0.9)]) == "vocabulary"
    assert way([lp.TopPLogitsWarper(0.9)]) == "vocabulary"
    assert way([lp.TopPLogitsWarper(0.9)], vocab=200) == "candidates"  # a vocabulary within the bound: all of it
    assert way([lp.TopKLogitsWarper(300)], candidates=512) == "candidates"
    monkeypatch.setenv(gsampling.TOPK_ENV, "5000")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_SAMPLING_TOPK=.5000.*1 to 4096"):
        gsampling.settings.get("sampling_topk")


def test_processors_without_a_device_version_are_named():
    assert sprogram.unsupported([lp.TemperatureLogitsWarper(0.7), lp.TypicalLogitsWarper(0.9)]) == "TypicalLogitsWarper"
    assert "filter_value" in sprogram.unsupported([lp.TopKLogitsWarper(5, filter_value=-1e9)])
    assert "min_tokens_to_keep" in sprogram.unsupported([lp.TopPLogitsWarper(0.9, min_tokens_to_keep=2)])
    assert "after the warpers" in sprogram.unsupported([lp.TopKLogitsWarper(5), lp.SuppressTokensLogitsProcessor([1])])

    class Custom(lp.TopKLogitsWarper):  # a subclass may compute something else: never taken for its base
        pass

    assert sprogram.unsupported([Custom(5)]) == "Custom"
    assert sprogram.unsupported([lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TopKLogitsWarper(5)]) is None


# --- generate() ----------------------------------------------------------------------------------------


def bytes_per_step(model, enc, **kwargs) -> tuple[float, dict]:
    model.generate(**enc, max_new_tokens=2, **kwargs)  # graphs and cache compiled
    simulator.reset_stats()
    torch.manual_seed(0)
    model.generate(**enc, max_new_tokens=4, **kwargs)
    short = simulator.stats()
    simulator.reset_stats()
    torch.manual_seed(0)
    model.generate(**enc, max_new_tokens=10, **kwargs)
    long = simulator.stats()
    assert long["compiles"] == short["compiles"] == 0
    assert long["eager_signatures"] == short["eager_signatures"]  # nothing grows with the tokens
    return (long["d2h_bytes"] - short["d2h_bytes"]) / 6, long


def test_a_sampled_step_sends_one_id_per_row(sim, model, tok, monkeypatch):
    """The issue's figure: 128,008 bytes a step for one row at a 32,000 vocabulary; here 2 rows of 512."""
    enc = on(model.device, tok([prompt(6), prompt(9, 3)], return_tensors="pt", padding=True))
    on_device, _ = bytes_per_step(model, enc, **SAMPLE)
    assert on_device <= 2 * 8 + 8  # one int64 id per row, plus upstream's own 8-byte read (5.x)
    monkeypatch.setenv(gsampling.DEVICE_SAMPLING_ENV, "0")
    on_host, _ = bytes_per_step(model, enc, **SAMPLE)
    assert on_host >= 2 * model.config.vocab_size * 4  # the float32 row of every prompt, every step


def test_penalties_and_bans_run_on_the_device_and_match_cpu(sim, model, reference, tok):
    enc = tok([prompt(7), prompt(4, 2)], return_tensors="pt", padding=True)
    kwargs = {
        "do_sample": False,
        "repetition_penalty": 1.4,
        "no_repeat_ngram_size": 2,
        "bad_words_ids": [[7], [12, 30]],
        "suppress_tokens": [5, 6],
        "min_new_tokens": 5,
        "eos_token_id": 2,
    }
    expected = reference.generate(**enc, max_new_tokens=10, **kwargs)
    device_enc = on(model.device, enc)
    out = model.generate(**device_enc, max_new_tokens=10, **kwargs)
    assert torch.equal(out.cpu(), expected)
    per_step, _ = bytes_per_step(model, device_enc, **kwargs)
    assert per_step <= 2 * 8 + 8


def test_sampling_with_top_k_1_is_greedy(sim, model, reference, tok):
    enc = tok([prompt(5), prompt(12, 4)], return_tensors="pt", padding=True)
    greedy = reference.generate(**enc, max_new_tokens=8, do_sample=False)
    sampled = model.generate(**on(model.device, enc), max_new_tokens=8, do_sample=True, top_k=1, temperature=1.7)
    assert torch.equal(sampled.cpu(), greedy)


def test_seeds_reproduce_with_dummy_rows_and_differ_between_seeds(sim, model, tok):
    enc = on(model.device, tok([prompt(6), prompt(11, 2), prompt(4, 5)], return_tensors="pt", padding=True))
    kwargs = {**SAMPLE, "max_new_tokens": 8, "num_return_sequences": 2}  # 6 rows: a batch bucket of 8
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(model.generate(**enc, **kwargs).cpu())
    assert runs[0].shape == (6, enc["input_ids"].shape[1] + 8)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    torch.neuron.manual_seed(11)  # the device's own generator is what the draw reads
    assert torch.equal(model.generate(**enc, **kwargs).cpu(), runs[0])


def test_rows_of_very_different_lengths_prefill_in_groups_and_sample_on_the_device(sim, model, tok, monkeypatch):
    """A long prompt among short ones: the prefill runs group by group (not every row at the long row's bucket)
    and the device's sampler draws from the groups' logits as it would from one prefill's (the same seed, the same
    tokens), one id per row crossing to the host."""
    import accelerate_neuron

    enc = tok([prompt(60)] + [prompt(n, offset=n) for n in (2, 3, 4)], return_tensors="pt", padding=True)
    kwargs = {**SAMPLE, "max_new_tokens": 6}
    runs = {}
    for grouped in ("1", "0"):
        monkeypatch.setenv("ACCELERATE_NEURON_GROUP_ROWS", grouped)
        accelerate_neuron.reset_padding_stats()
        torch.manual_seed(5)
        runs[grouped] = (model.generate(**enc, **kwargs).cpu(), accelerate_neuron.padding_stats()["generate_prefill"])
    (together, one_prefill), (apart, grouped_prefill) = runs["0"], runs["1"]
    assert torch.equal(apart, together)
    assert grouped_prefill["real"] == one_prefill["real"] and grouped_prefill["computed"] < one_prefill["computed"] / 2
    monkeypatch.setenv("ACCELERATE_NEURON_GROUP_ROWS", "1")
    per_step, _ = bytes_per_step(model, on(model.device, enc), **SAMPLE)
    assert per_step <= 4 * 8 + 8  # one id per row: the sampler is still on the device


def sampling_graphs(stats: dict) -> int:
    return sum(1 for g in stats["graphs"] if (g.get("frame") or {}).get("function") == "sampling_step")


def test_graphs_bounded_across_prompt_lengths_and_parameter_values(sim, reference, tok):
    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    policy = shapes.resolve_policy(fresh.config.max_position_embeddings)
    simulator.reset_stats()
    buckets, caches = set(), set()
    for words in (2, 5, 9, 14, 20, 27, 35, 44):  # 8 prompt lengths (2 to 76 tokens)
        enc = tok([prompt(words)], return_tensors="pt")
        bucket = policy.prompt_bucket(enc["input_ids"].shape[1])
        buckets.add(bucket)
        caches.add(gcache.bucket_length(bucket + 4 - 1, fresh.config.max_position_embeddings, "pow2"))
        fresh.generate(**on(fresh.device, enc), max_new_tokens=4, **SAMPLE)
    lengths = simulator.stats()
    assert sampling_graphs(lengths) == 1  # one row, one vocabulary: one sampling graph for every prompt
    # A prefill per prompt bucket, a decode per cache bucket, and the sampler: nothing per length.
    assert len(buckets) >= 3 and lengths["compiles"] == len(buckets) + len(caches) + 1

    enc = on(fresh.device, tok([prompt(9)], return_tensors="pt"))
    fresh.generate(**enc, max_new_tokens=4, **SAMPLE)  # the cache upstream keeps is now the longest prompt's
    simulator.reset_stats()
    for temperature, top_p, top_k in [(0.3, 0.5, 10), (1.0, 0.95, 200), (1.6, 0.7, 3), (0.9, 0.99, 256)]:
        fresh.generate(**enc, max_new_tokens=4, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    assert simulator.stats()["compiles"] == 0  # values are tensors (temperature 1.0 too): no graph per value


def test_a_processor_without_a_device_version_keeps_the_host_path_and_is_named_once(sim, model, tok, caplog):
    enc = on(model.device, tok([prompt(6)], return_tensors="pt"))
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        per_step, _ = bytes_per_step(model, enc, do_sample=True, typical_p=0.9)
    assert per_step >= model.config.vocab_size * 4
    named = [r for r in caplog.records if "TypicalLogitsWarper" in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in caplog.records]


def test_scores_asked_for_keep_the_host_path(sim, model, reference, tok):
    enc = tok([prompt(6)], return_tensors="pt")
    kwargs = {**SAMPLE, "max_new_tokens": 4, "return_dict_in_generate": True, "output_scores": True}
    torch.manual_seed(5)
    expected = reference.generate(**enc, **kwargs)
    torch.manual_seed(5)
    out = model.generate(**on(model.device, enc), **kwargs)
    assert torch.equal(out.sequences.cpu(), expected.sequences)  # the host path: the CPU's own draw
    assert all(torch.allclose(a.cpu(), b, atol=1e-5) for a, b in zip(out.scores, expected.scores, strict=True))


def test_device_sampling_off_is_upstreams_host_path(sim, model, reference, tok, monkeypatch):
    monkeypatch.setenv(gsampling.DEVICE_SAMPLING_ENV, "off")
    enc = tok([prompt(6), prompt(11, 2)], return_tensors="pt", padding=True)
    torch.manual_seed(3)
    expected = reference.generate(**enc, max_new_tokens=6, **SAMPLE)
    torch.manual_seed(3)
    assert torch.equal(model.generate(**on(model.device, enc), max_new_tokens=6, **SAMPLE).cpu(), expected)


# --- continuous batching ---------------------------------------------------------------------------------

_CB = importlib.util.find_spec("transformers.generation.continuous_batching.model_runner") is not None
SERVING_ENV = {
    "ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS": "32",
    "ACCELERATE_NEURON_SERVING_KV_BUCKETS": "1024",
    "ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS": "1024",
}


@pytest.mark.skipif(
    not _CB, reason="4.57's continuous batching has no compiled step (no model_runner): the serving patches skip"
)
def test_continuous_batching_samples_mixed_temperatures_in_its_compiled_step(sim, model, reference, tok, monkeypatch):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    for key, value in SERVING_ENV.items():
        monkeypatch.setenv(key, value)
    traced = {"warp": 0, "draw": 0}
    for name, key in (("warp_candidates", "warp"), ("draw", "draw")):
        original = getattr(ops, name)

        def spy(*args, _original=original, _key=key, **kwargs):
            traced[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    from transformers.generation.continuous_batching import model_runner

    steps: list[set[float]] = []  # each step's per-request argument values, read at the compiled step's door
    compute_batch = model_runner.ModelRunner.compute_batch

    def spy_batch(self, model, batch_data):
        args = batch_data["logits_processor_args"]
        steps.append(set(args.cpu().view(torch.float32).flatten().tolist()) if args is not None else set())
        return compute_batch(self, model, batch_data)

    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", spy_batch)
    torch._dynamo.reset()
    prompts = [tok(prompt(n, 3 * i))["input_ids"] for i, n in enumerate([4, 6, 5, 7])]  # 35 tokens: one batch
    config = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=0.8, top_k=50, top_p=0.95, eos_token_id=2, pad_token_id=0
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(per_request_processors=True)
    )
    manager.warmup()
    warm = simulator.stats()
    assert traced["warp"] and traced["draw"]  # the compiled step runs the device warpers and draw
    steps.clear()
    manager.start()
    per_request = [{"top_k": 1}, {"temperature": 0.3}, {"temperature": 1.5, "top_p": 0.5}, {"temperature": 1.1}]
    try:
        ids = [
            manager.add_request(input_ids=p, max_new_tokens=8, **kw) for p, kw in zip(prompts, per_request, strict=True)
        ]
        done, deadline = {}, time.monotonic() + 300
        while len(done) < len(ids):
            assert time.monotonic() < deadline, done
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert all(r.error is None and r.generated_tokens for r in done.values()), done
    after = simulator.stats()
    assert after["compiles"] == warm["compiles"]  # four temperatures, one set of graphs
    mixed = {torch.tensor(t).item() for t in (0.3, 1.5, 1.1)}  # as float32, upstream's encoding
    assert any(mixed <= values for values in steps), steps  # three requests' temperatures in one step's rows
    # Only the sampled ids (and upstream's bookkeeping) come back: less than one float32 logits row per step,
    # while a step samples up to four rows.
    per_step = (after["d2h_bytes"] - warm["d2h_bytes"]) / len(steps)
    assert per_step < model.config.vocab_size * 4, (per_step, len(steps))
    greedy_config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0)
    greedy = reference.generate(torch.tensor([prompts[0]]), generation_config=greedy_config)
    assert done[ids[0]].generated_tokens == greedy[0, len(prompts[0]) :].tolist()  # top_k=1 is greedy


def _cb_args(rows: list[tuple[float, int, float]], kinds: tuple[str, ...], width: int = 8) -> torch.Tensor:
    """Continuous batching's per-request argument tensor (``[processors, max tokens]`` int32), upstream's encoding."""
    args = torch.zeros((len(kinds), width), dtype=torch.int32)
    for i, kind in enumerate(kinds):
        column = {"temperature": 0, "top_k": 1, "top_p": 2}[kind]
        values = [row[column] for row in rows]
        if kind == "top_k":
            args[i, : len(rows)] = torch.tensor(values, dtype=torch.int32)
        else:
            args[i, : len(rows)] = torch.tensor(values, dtype=torch.float32).view(torch.int32)
    return args


@pytest.mark.skipif(not _CB, reason="4.57's continuous batching has no per-request processors (no model_runner)")
@pytest.mark.parametrize("with_top_k", [True, False], ids=["temperature, top_k, top_p", "temperature, top_p"])
def test_continuous_batching_per_request_warpers_equal_upstreams(sim, with_top_k):
    """Mixed per-request values in one batch: the device's warped distribution is upstream's, row by row.

    A request's top_k above the 256 candidates gets upstream's distribution for top_k=256 (the documented bound).
    """
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )

    from accelerate_neuron.builtin.serving import sampling as ssampling

    warpers = [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(50), lp.TopPLogitsWarper(0.95)]
    if not with_top_k:
        del warpers[1]
    processors = ContinuousBatchingLogitsProcessorList(lp.LogitsProcessorList(warpers), per_request_processors=True)
    assert ssampling.warper_tail(list(processors.logits_processor)) == 0  # all of them run on the device
    kinds = ("temperature", "top_k", "top_p") if with_top_k else ("temperature", "top_p")
    # (temperature, top_k, top_p) per request; a flat row (index 3) so top_p alone keeps far more than 256 tokens
    rows = [(0.3, 1, 0.9), (1.5, 50, 0.5), (0.8, 300, 1.0), (1.0, 256, 0.9), (2.0, 10, 0.99), (1.1, 7, 0.3)]
    logits, ids = fixed_logits(rows=len(rows))
    logits[3] *= 0.02
    host = processors(ids.clone(), logits.clone(), _cb_args(rows, kinds)).softmax(-1)
    device = processors(ids.to("neuron"), logits.to("neuron"), _cb_args(rows, kinds).to("neuron")).softmax(-1).cpu()
    if with_top_k:
        bounded = [(t, min(k, 256), p) for t, k, p in rows]
        at_bound = processors(ids.clone(), logits.clone(), _cb_args(bounded, kinds)).softmax(-1)
        assert not torch.equal(host[2] > 0, at_bound[2] > 0)  # top_k 300 keeps more than 256 upstream ...
        assert (device[2] > 0).sum() == 256  # ... and 256 on the device: the bound
        host = at_bound
    else:
        assert (host[3] > 0).sum() > 600  # the flat row's nucleus: beyond any candidate set, exact here
    assert torch.equal(device > 0, host > 0)
    torch.testing.assert_close(device, host, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.one_pair  # 4.57 has no per-request sampling in continuous batching: the newest pair's subject only
@pytest.mark.skipif(
    not _CB or importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
    reason="`transformers serve --continuous-batching` needs 5.x's model_runner, fastapi and uvicorn",
)
def test_transformers_serve_samples_each_requests_settings_with_the_graphs_of_its_warm_up(tmp_path, reference, tok):
    """A chat model's server (its generation config samples) answers requests with their own temperature and
    top_p through the official client: no graph per value after the warm-up, a request's seed reproduces its
    tokens, temperature 0 gives the CPU's greedy tokens."""
    from openai import OpenAI
    from transformers import GenerationConfig

    from test_serving import LAZY_SERVE, _graphs_by_frame  # here: it skips itself on 4.57

    folder = tiny.save_pretrained(tmp_path / "tiny-qwen3-chat", "qwen3", **QWEN)
    chat = GenerationConfig(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, eos_token_id=2, pad_token_id=0)
    chat.save_pretrained(folder)  # as a chat model ships: sampling by default, so serve's batches sample
    cache = Path(fresh_neff_cache_dir())
    server, port = serve_under_simulate(str(folder), 1, cache, SERVING_ENV)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        if LAZY_SERVE:  # serve up to 5.24 starts continuous batching (and the plugin's warm-up) at a first request
            client.completions.create(model=str(folder), prompt=prompt(3), max_tokens=2, temperature=0)
        warmed = _graphs_by_frame(cache)
        assert warmed

        def complete(text: str, **kwargs) -> str:
            answer = client.completions.create(model=str(folder), prompt=text, max_tokens=8, **kwargs)
            assert answer.usage.completion_tokens > 0
            return answer.choices[0].text

        settings = [(0.3, 0.5), (1.4, 0.95), (0.9, 0.8), (1.0, 0.99)]
        with ThreadPoolExecutor(len(settings)) as pool:  # at once: the server batches them together
            texts = list(
                pool.map(
                    lambda i: complete(prompt(9, i), temperature=settings[i][0], top_p=settings[i][1]),
                    range(len(settings)),
                )
            )
        assert len(texts) == len(settings)
        first, again = (complete(prompt(7, 4), temperature=1.3, seed=1234) for _ in range(2))
        assert first == again  # the request's seed seeds the device's generator
        text = prompt(12, 5)
        expected = reference.generate(
            torch.tensor([tok(text)["input_ids"]]), max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0
        )
        greedy = tok.decode(expected[0, len(tok(text)["input_ids"]) :], skip_special_tokens=True)
        assert complete(text, temperature=0) == greedy  # serve sends top_k=1: the candidates path's argmax
        assert _graphs_by_frame(cache) == warmed  # five temperatures, three top_p values: the warm-up's graphs
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            _, output = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            _, output = server.communicate()
    assert "compiled a new graph after its warm-up" not in output, output[-4000:]
