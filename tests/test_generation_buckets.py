"""generate() on Neuron compiles a bounded set of graphs: prompt-length and batch buckets, compiled prefill.

The workload of issue 11: a stock script generating for prompts of many lengths,
one by one and in left-padded batches. Every result is compared with the
unpadded CPU reference (same weights, float32); the graphs and eager signatures
are what Neuron would compile.
"""

# ruff: noqa: F811 - the fixtures imported from test_generation are parameters of the tests below

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from accelerate_neuron import hookimpl, plugins, simulator, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.generation import cache as gcache
from accelerate_neuron.builtin.generation import groups
from test_generation import QWEN, T5, _clean_dynamo, model, on, reference, tok  # noqa: F401 - shared fixtures

WORDS = tiny.CORPUS.split()
#: Prompt lengths in words (3 to 47): 12 different token lengths, over three prompt buckets.
LENGTHS = [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
NEW = 16


def prompt(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def graph_shapes(stats: dict, hits: bool = False) -> list[tuple[list[int], int | None]]:
    """(input_ids shape, KV length the attention mask spans) of every graph compiled (NEFF cache misses).

    ``hits``: also the graphs Dynamo traced again but the NEFF cache already held (no compile on Neuron).
    """
    found = []
    for graph in stats["graphs"]:
        if graph.get("cache") == "hit" and not hits:
            continue
        ids = next((x["shape"] for x in graph["dynamo_inputs"] if x["name"].endswith("['input_ids']")), None)
        masks = [x["shape"] for x in graph["dynamo_inputs"] if "attention_mask" in x["name"] and len(x["shape"]) == 4]
        found.append((ids, masks[0][-1] if masks else None))
    return found


def test_varied_prompts_compile_one_graph_per_bucket_and_match_cpu(sim, reference, tok):
    torch._dynamo.reset()
    model = tiny.model("qwen3", **QWEN).to("neuron")
    policy = shapes.resolve_policy(model.config.max_position_embeddings)
    simulator.reset_stats()
    growth, seen_cache = [], set()
    touched_prompt, touched_cache = set(), set()
    for words in LENGTHS:
        enc = tok(prompt(words), return_tensors="pt")
        before = simulator.stats()["eager_signatures"]
        out = model.generate(**on(model.device, enc), do_sample=False, max_new_tokens=NEW)
        assert out.device == model.device
        expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out.cpu(), expected), words
        length = enc["input_ids"].shape[1]
        bucket = policy.prompt_bucket(length)
        touched_prompt.add((bucket, 1))
        cache_len = gcache.bucket_length(bucket + NEW - 1, model.config.max_position_embeddings, "pow2")
        touched_cache.add((cache_len, 1))
        growth.append((simulator.stats()["eager_signatures"] - before, cache_len in seen_cache))
        seen_cache.add(cache_len)
    assert len({tok(prompt(w))["input_ids"].__len__() for w in LENGTHS}) == len(LENGTHS)
    # After the first prompt, a new prompt length adds no eager signature unless it needs a new cache
    # bucket, which costs its allocation only (a few ops of the cache's shape), never ~60 per length.
    assert all(added == 0 for added, cache_seen in growth[1:] if cache_seen), growth
    assert all(added <= 4 for added, _ in growth[1:]), growth
    for size in (2, 4):
        texts = [prompt(w, offset=size) for w in LENGTHS[:8]]
        for i in range(0, 8, size):
            enc = tok(texts[i : i + size], return_tensors="pt", padding=True)
            out = model.generate(**on(model.device, enc), do_sample=False, max_new_tokens=NEW)
            expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
            assert torch.equal(out.cpu(), expected), (size, i)
            bucket = policy.prompt_bucket(enc["input_ids"].shape[1])
            # Rows of different prompt buckets prefill group by group (see test_rows_of_very_different_lengths...).
            planned = groups.plan(
                groups.extents(enc["attention_mask"], enc["input_ids"].shape[1]),
                bucket,
                policy.prompt_buckets,
                policy.batch_buckets,
                size,
            )
            touched_prompt.update({(g.bucket, g.padded_rows) for g in planned} if planned else {(bucket, size)})
            touched_cache.add((gcache.bucket_length(bucket + NEW - 1, 256, "pow2"), size))
    stats = simulator.stats()
    found = graph_shapes(stats)
    prefill = [(ids[0], ids[1], kv) for ids, kv in found if ids[1] > 1]
    decode = [(ids[0], kv) for ids, kv in found if ids[1] == 1]
    assert len(prefill) + len(decode) == stats["compiles"]
    # Never two graphs for one prefill shape and cache; a shape runs on the call's cache, or as a group on a
    # cache of its own bucket's length (a one-row group of the 16 bucket and a one-row call: two graphs).
    assert len(set(prefill)) == len(prefill), prefill
    prefill_shapes = {(rows, columns) for rows, columns, _ in prefill}
    assert len(prefill_shapes) <= len(touched_prompt) and len(prefill) <= 2 * len(prefill_shapes), prefill
    assert {b for b, _, _ in prefill} <= {1, 2, 4}
    assert all(n in (b, b - 1) for _, n, _ in prefill for b in [policy.prompt_bucket(n)]), prefill  # 4.x: bucket - 1
    assert len(decode) <= len(touched_cache), (decode, touched_cache)
    assert stats["eager_signatures"] <= 40  # the stock script paid 680 for the single prompts alone


@pytest.mark.parametrize("sample", [False, True])
def test_rows_of_very_different_lengths_prefill_in_groups_and_match_cpu(sim, reference, tok, sample, monkeypatch):
    """One long row no longer pads seven short ones to its bucket: each group prefills at its own, decode together.

    Sampling on the host's path (the CPU's numbers); sampling on the device: test_sampling's grouped case.
    """
    import accelerate_neuron

    monkeypatch.setenv("ACCELERATE_NEURON_DEVICE_SAMPLING", "0")

    torch._dynamo.reset()
    model = tiny.model("qwen3", **QWEN).to("neuron")
    texts = [prompt(60)] + [prompt(n, offset=n) for n in (2, 3, 3, 4, 5, 2, 4)]  # 1 long row, 7 short ones
    enc = tok(texts, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(dim=1).tolist()
    assert 64 < lengths[0] <= 128 and max(lengths[1:]) <= 16
    accelerate_neuron.reset_padding_stats()
    simulator.reset_stats()
    kwargs = {"do_sample": sample, "max_new_tokens": 6}
    torch.manual_seed(0)
    out = model.generate(**enc, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(out.cpu(), reference.generate(**enc, **kwargs))
    prefill = {tuple(ids) for ids, _ in graph_shapes(simulator.stats()) if ids[1] > 1}
    # The 7 short rows at 16 columns (batch bucket 8), the long one alone at 128: never 8 rows x 128.
    assert prefill in ({(8, 16), (1, 128)}, {(8, 15), (1, 127)}), prefill  # 4.x prefills all but the last token
    stats = accelerate_neuron.padding_stats()["generate_prefill"]
    columns = 0 if (8, 16) in prefill else 1  # 4.x: the last prompt token is the first decode step's
    assert stats["computed"] == 8 * (16 - columns) + 1 * (128 - columns) < 8 * (128 - columns)
    assert stats["real"] == sum(lengths) - columns * len(lengths)


def test_stock_recipe_pays_per_length(sim, tok, unpatched):
    """The baseline the buckets are measured against: upstream's own static-cache recipe."""
    torch._dynamo.reset()
    model = tiny.model("qwen3", **QWEN).to("neuron")
    with unpatched():
        simulator.reset_stats()
        counts = []
        for words in LENGTHS[:4]:
            enc = on(model.device, tok(prompt(words), return_tensors="pt"))
            model.generate(**enc, do_sample=False, max_new_tokens=4, cache_implementation="static")
            counts.append(simulator.stats()["eager_signatures"])
    assert all(b - a >= 20 for a, b in itertools.pairwise(counts)), counts


def test_batch_rows_never_reach_the_caller(sim, model, reference, tok):
    texts = [prompt(5), prompt(9, 3), prompt(13, 7)]  # 3 rows -> a batch bucket of 4
    enc = tok(texts, return_tensors="pt", padding=True)
    seen = []

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(tuple(input_ids.shape))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kwargs = {"do_sample": False, "max_new_tokens": 5, "return_dict_in_generate": True, "output_scores": True}
    expected = reference.generate(**enc, **kwargs)
    out = model.generate(**on(model.device, enc), stopping_criteria=StoppingCriteriaList([Watch()]), **kwargs)
    assert torch.equal(out.sequences.cpu(), expected.sequences)
    assert [s.shape for s in out.scores] == [s.shape for s in expected.scores]
    assert all(torch.allclose(a.cpu(), b, atol=1e-4) for a, b in zip(out.scores, expected.scores, strict=True))
    width = enc["input_ids"].shape[1]
    assert seen == [(3, width + i) for i in range(1, 6)]  # stopping criteria see the caller's rows and columns


def test_sampling_on_the_host_path_is_reproducible_and_matches_cpu(sim, model, reference, tok, monkeypatch):
    """Dummy rows never reach the host's draw (sampling on the device: tests/test_sampling.py)."""
    monkeypatch.setenv("ACCELERATE_NEURON_DEVICE_SAMPLING", "0")
    enc = tok([prompt(6), prompt(11, 2), prompt(4, 5)], return_tensors="pt", padding=True)
    kwargs = {"do_sample": True, "top_k": 20, "max_new_tokens": 8, "num_return_sequences": 2}
    torch.manual_seed(11)
    expected = reference.generate(**enc, **kwargs)
    torch.manual_seed(11)
    first = model.generate(**on(model.device, enc), **kwargs)
    torch.manual_seed(11)
    again = model.generate(**on(model.device, enc), **kwargs)
    assert first.shape == expected.shape == (6, enc["input_ids"].shape[1] + 8)
    assert torch.equal(first.cpu(), again.cpu())
    assert torch.equal(first.cpu(), expected)


def test_beam_search_with_buckets_matches_cpu(sim, model, reference, tok):
    enc = tok([prompt(7), prompt(12, 4)], return_tensors="pt", padding=True)
    kwargs = {"num_beams": 3, "do_sample": False, "max_new_tokens": 6}
    assert torch.equal(model.generate(**on(model.device, enc), **kwargs).cpu(), reference.generate(**enc, **kwargs))


def test_returned_cache_continues_like_upstream(sim, model, reference, tok):
    """The returned past_key_values is in the caller's layout: a second generate() continues from it."""
    enc = tok([prompt(6)], return_tensors="pt")
    kwargs = {"do_sample": False, "max_new_tokens": 4, "return_dict_in_generate": True}
    first = model.generate(**on(model.device, enc), **kwargs)
    cache = first.past_key_values
    layer = getattr(cache, "self_attention_cache", cache).layers[0]
    assert layer.keys.shape[0] == 1  # no dummy rows
    assert int(cache.get_seq_length()) == enc["input_ids"].shape[1] + 3  # the last new token is not cached yet
    follow = torch.cat([first.sequences.cpu(), tok(" the", return_tensors="pt")["input_ids"]], dim=-1)
    expected = reference.generate(follow, attention_mask=torch.ones_like(follow), do_sample=False, max_new_tokens=4)
    out = model.generate(
        follow.to(model.device),
        attention_mask=torch.ones_like(follow).to(model.device),
        past_key_values=cache,
        do_sample=False,
        max_new_tokens=4,
    )
    assert torch.equal(out.cpu(), expected)


def test_left_padded_batch_already_at_its_buckets_keeps_upstreams_positions(sim, model, reference, tok):
    # Longest prompt exactly at a prompt bucket, batch exactly at a batch bucket: the plugin pads nothing, yet the
    # prefill still runs through upstream's chunked path, and 4.x's chunked prefill numbers positions 0..n-1
    # whatever the caller's left padding (found on 4.57.6 by the workload benchmark: a 57-token row next to a
    # 1,024-token one generated other tokens). Upstream's unchunked call, the CPU reference, counts from the mask.
    policy = shapes.resolve_policy(model.config.max_position_embeddings)
    width, rows = policy.prompt_buckets[0], 2
    assert rows in policy.batch_buckets
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, : width - 5] = 0  # row 0: a 5-token prompt, left padded
    ids[0, : width - 5] = tok.pad_token_id or 0
    kwargs = {"do_sample": False, "max_new_tokens": 8}
    expected = reference.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kwargs)
    assert torch.equal(out.cpu(), expected)


def test_right_padded_inputs_give_upstreams_result(sim, model, reference, tok):
    tok_right = tiny.tokenizer()
    tok_right.padding_side = "right"
    enc = tok_right([prompt(4), prompt(9, 1)], return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, -1] == 0).any()
    kwargs = {"do_sample": False, "max_new_tokens": 5}
    assert torch.equal(model.generate(**on(model.device, enc), **kwargs).cpu(), reference.generate(**enc, **kwargs))


def test_pipeline_over_a_list_with_batch_size(sim, model, reference, tok):
    texts = [prompt(w, w) for w in (3, 8, 13, 5, 21)]
    stock = transformers.pipeline("text-generation", model=reference, tokenizer=tok, device="cpu")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="neuron")
    kwargs = {"max_new_tokens": 5, "do_sample": False, "batch_size": 2}
    simulator.reset_stats()
    assert pipe(texts, **kwargs) == stock(texts, **kwargs)


def test_encoder_decoder_buckets_the_encoder_length(sim, tok):
    reference = tiny.model("t5", **T5)
    t5 = tiny.model("t5", **T5).to("neuron")
    t5.generate(**on(t5.device, tok([prompt(2)], return_tensors="pt")), max_new_tokens=5, do_sample=False)
    t5.generate(**on(t5.device, tok([prompt(2)], return_tensors="pt")), max_new_tokens=5, do_sample=False)
    simulator.reset_stats()  # warm: 4.x builds its cache on the first call and resets it on later ones
    counts = []
    for words in (3, 6, 9, 11):  # 3 to 16 tokens: the 16 bucket
        enc = tok([prompt(words)], return_tensors="pt")
        out = t5.generate(**on(t5.device, enc), max_new_tokens=5, do_sample=False)
        assert torch.equal(out.cpu(), reference.generate(**enc, max_new_tokens=5, do_sample=False)), words
        counts.append(simulator.stats()["eager_signatures"])
    assert counts[1:] == counts[:1] * 3, counts  # four encoder lengths, one bucket: one set of eager ops


def test_prompt_beyond_the_largest_bucket_runs_unpadded_with_one_warning(sim, model, reference, tok, monkeypatch):
    monkeypatch.setenv(shapes.PROMPT_BUCKETS_ENV, "32")
    enc = tok([prompt(40)], return_tensors="pt")
    length = enc["input_ids"].shape[1]
    assert length > 32
    logger = logging.getLogger("accelerate_neuron")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        for _ in range(2):
            out = model.generate(**on(model.device, enc), do_sample=False, max_new_tokens=4)
            assert torch.equal(out.cpu(), reference.generate(**enc, do_sample=False, max_new_tokens=4))
    finally:
        logger.removeHandler(handler)
    beyond = [r for r in records if "largest bucket" in r.getMessage()]
    assert len(beyond) == 1 and f"prompt length of {length}" in beyond[0].getMessage()


def test_opt_out_and_announcement(sim, tok, monkeypatch, caplog):
    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    enc = tok([prompt(5)], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        fresh.generate(**on(fresh.device, enc), do_sample=False, max_new_tokens=3)
        fresh.generate(**on(fresh.device, enc), do_sample=False, max_new_tokens=3)
    lines = [r.getMessage() for r in caplog.records if "length buckets" in r.getMessage()]
    assert len(lines) == 1
    assert shapes.PROMPT_BUCKETS_ENV in lines[0] and "=off" in lines[0]
    prefill = [ids for ids, _ in graph_shapes(simulator.stats()) if ids[1] > 1]
    assert prefill and all(n in (15, 16) for _, n in prefill)

    monkeypatch.setenv(shapes.PROMPT_BUCKETS_ENV, "off")
    monkeypatch.setenv(shapes.BATCH_BUCKETS_ENV, "off")
    torch._dynamo.reset()
    simulator.reset_stats()
    fresh.generate(**on(fresh.device, enc), do_sample=False, max_new_tokens=3)
    found = graph_shapes(simulator.stats(), hits=True)  # the decode graph was compiled (cached) above
    assert [ids[1] for ids, _ in found] == [1]  # upstream's path: eager prefill, compiled decode only

    monkeypatch.setenv(shapes.PROMPT_BUCKETS_ENV, "64,32")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_PROMPT_BUCKETS='64,32'.*ascending"):
        fresh.generate(**on(fresh.device, enc), do_sample=False, max_new_tokens=3)


def test_shape_policy_hook(sim, tok):
    class Policy:
        @hookimpl
        def neuron_generation_shape_policy(self, max_position_embeddings):
            return {"prompt_buckets": [16, max_position_embeddings], "batch_buckets": [8]}

    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    enc = tok([prompt(5)], return_tensors="pt")
    with plugins.registered(Policy(), "test-shape-policy"):
        assert shapes.resolve_policy(256) == shapes.ShapePolicy((16, 256), (8,))
        simulator.reset_stats()
        fresh.generate(**on(fresh.device, enc), do_sample=False, max_new_tokens=3)
    batches = {ids[0] for ids, _ in graph_shapes(simulator.stats())}
    assert batches == {8}

    class Broken:
        @hookimpl
        def neuron_generation_shape_policy(self, max_position_embeddings):
            return {"prompt_buckets": [64, 32]}

    with plugins.registered(Broken(), "test-broken-policy"), pytest.raises(ValueError, match="ascending"):
        shapes.resolve_policy(256)


@pytest.mark.parametrize(
    ("max_pos", "expected"),
    [
        (256, (16, 32, 64, 128, 256)),
        (100, (16, 32, 64, 100)),
        (None, (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)),
    ],
)
def test_default_prompt_buckets(max_pos, expected):
    assert shapes.pow2_prompt_buckets(max_pos) == expected


def test_policy_picks_the_smallest_bucket():
    policy = shapes.ShapePolicy((32, 64), (1, 2, 4))
    assert [policy.prompt_bucket(n) for n in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, None]
    assert [policy.batch_bucket(n) for n in (1, 3, 4, 5)] == [1, 4, 4, None]
    assert shapes.ShapePolicy((), ()).prompt_bucket(3) is None
