"""The shape layer (``builtin/shapes``): bucket sets, their bounds, the pad values and the pad token id.

Every capability pads through it, so what is checked here holds for generate(), inference calls,
training batches and continuous batching alike; the capabilities' own tests check their results
against the CPU's.
"""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from accelerate_neuron import hookimpl, plugins, settings, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.training.collate import pad_values_for
from accelerate_neuron.builtin.training.shapes import ShapePolicy, pad_batch, resolve_policy

PROMPT_ENV = "ACCELERATE_NEURON_PROMPT_BUCKETS"


@pytest.mark.one_pair
def test_a_bucket_set_picks_the_smallest_bucket_and_says_once_when_none_holds(caplog) -> None:
    buckets = shapes.Buckets((32, 64), "prompt_buckets")
    assert [buckets.at_least(n) for n in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, None]
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert [buckets.pad_to(n, "generate()", "prompt length") for n in (3, 33, 70, 70)] == [32, 64, 70, 70]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "generate() got a prompt length of 70, more than the largest bucket (64)" in said[0]
    assert PROMPT_ENV in said[0]
    assert shapes.Buckets((), "prompt_buckets").pad_to(5, "generate()", "prompt length") == 5  # off: as is
    assert buckets == (32, 64) and pickle.loads(pickle.dumps(buckets)).setting == "prompt_buckets"
    for bad in ((64, 32), (0, 8), (8, 2**31)):
        with pytest.raises(ValueError, match="strictly ascending ints from 1 to 2147483647"):
            shapes.Buckets(bad)


@pytest.mark.one_pair
def test_power_of_two_lists_end_at_their_limit() -> None:
    assert shapes.pow2(32, 100) == (32, 64, 100)
    assert shapes.pow2(32, 16) == (16,)  # a model shorter than the first bucket: its own length
    assert shapes.pow2_batch_buckets() == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert shapes.pow2_prompt_buckets(None)[-1] == 8192
    assert shapes.round_up_pow2(65, 64) == 128 and shapes.round_up_pow2(3, 64) == 64
    assert shapes.Buckets((16, 64)).ending_at(512) == (16, 64, 512)  # a step budget is always a bucket
    assert shapes.Buckets((16, 1024)).ending_at(512) == (16, 512)


@pytest.mark.one_pair
def test_the_buckets_a_bounded_size_can_reach() -> None:
    buckets = shapes.Buckets((32, 64, 128), "serving_token_buckets")
    assert [buckets.reaching(n) for n in (1, 32, 33, 128)] == [(32,), (32,), (32, 64), (32, 64, 128)]
    assert buckets.reaching(None) == buckets.reaching(500) == buckets  # unbounded, or beyond the largest: all
    assert buckets.reaching(40).setting == "serving_token_buckets"


@pytest.mark.one_pair
def test_a_user_bucket_beyond_the_models_positions_is_capped_naming_both(monkeypatch, caplog) -> None:
    """Issue 34, finding 6: 100000 on a 256-position model used to pad prompts to 100000 (memory exhausted)."""
    monkeypatch.setenv(PROMPT_ENV, "64,100000")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        policy = shapes.resolve_policy(256)
        assert shapes.resolve_policy(256) == policy
    assert policy.prompt_buckets == (64, 256)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "100000" in said[0] and "max_position_embeddings (256)" in said[0], said
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128,100000")
    assert resolve_policy(512).buckets == (128, 512)  # training: the same cap


@pytest.mark.one_pair
@pytest.mark.parametrize("name", ["prompt_buckets", "batch_buckets", "cache_buckets", "train_buckets"])
def test_a_bucket_past_what_a_shape_holds_is_refused_where_it_is_set(name, monkeypatch) -> None:
    """``99999999999999999999`` used to reach ``torch.zeros`` and fail there with a TypeError."""
    env = settings.env_name(name)
    monkeypatch.setenv(env, "99999999999999999999")
    with pytest.raises(settings.SettingError, match=rf"{env}='99999999999999999999'.*larger than 2147483647"):
        settings.get(name)
    monkeypatch.delenv(env)

    class Huge:
        @hookimpl
        def neuron_generation_shape_policy(self, max_position_embeddings):
            return {"prompt_buckets": [2**40]}

    with plugins.registered(Huge(), "test-huge-buckets"), pytest.raises(ValueError, match="larger than 2147483647"):
        shapes.resolve_policy(256)


def test_each_purpose_has_its_built_in_buckets_and_a_plugin_without_the_argument_answers_both(monkeypatch) -> None:
    monkeypatch.delenv(PROMPT_ENV, raising=False)
    generate, forward = shapes.resolve_policy(256), shapes.resolve_policy(256, purpose="forward")
    assert list(generate.prompt_buckets) == [16, 32, 64, 128, 256]
    assert list(forward.prompt_buckets) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert list(forward.batch_buckets) == list(generate.batch_buckets)  # batches: powers of two for both
    monkeypatch.setenv(PROMPT_ENV, "pow2")  # the user's value wins over the built-in answer for either purpose
    assert list(shapes.resolve_policy(256, purpose="forward").prompt_buckets) == [16, 32, 64, 128, 256]
    monkeypatch.delenv(PROMPT_ENV)

    class Older:  # written before the hook had a purpose
        @hookimpl
        def neuron_generation_shape_policy(self, max_position_embeddings):
            return {"prompt_buckets": [40, 80]}

    with plugins.registered(Older(), "test-older-shape-policy"):
        for purpose in ("generate", "forward"):
            assert list(shapes.resolve_policy(256, purpose=purpose).prompt_buckets) == [40, 80]


def test_generate_with_a_prompt_bucket_beyond_the_models_positions_matches_cpu(sim, monkeypatch, caplog) -> None:
    torch._dynamo.reset()
    tok = tiny.tokenizer()
    cpu = tiny.model("qwen3", initializer_range=0.3)
    model = tiny.model("qwen3", initializer_range=0.3).to("neuron")
    monkeypatch.setenv(PROMPT_ENV, "100000")
    enc = tok(["the quick brown fox jumps over"], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), cpu.generate(**enc, max_new_tokens=4, do_sample=False))
    widths = {
        x["shape"][1]
        for g in sim.stats()["graphs"]
        for x in g["dynamo_inputs"]
        if x["name"].endswith("['input_ids']") and x["shape"][1] > 1
    }
    # The prefill padded to the model's 256 positions, not to 100000 (4.x prefills all but the last token there).
    assert widths in ({256}, {255}), widths
    assert any("100000" in r.getMessage() and "(256)" in r.getMessage() for r in caplog.records)


@pytest.mark.one_pair
def test_position_pads_never_join_a_real_sequence() -> None:
    """Why ``position_ids`` pads with 0 on either side (generate() used to pad with 1 on the left).

    Where a model reads sequence boundaries from the positions (a padding-free batch without a mask),
    a 0 starts a sequence of its own: a pad is never part of a real one. A 1 after a one-token sequence
    (position 0) would continue it.
    """
    fill = shapes.PAD_VALUES["position_ids"]
    assert fill == 0
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])  # three sequences flattened into one row; the last is one token
    real = find_packed_sequence_indices(packed)[0].tolist()
    for left in (False, True):
        groups = find_packed_sequence_indices(shapes.pad_columns(packed, 10, fill, left=left))[0].tolist()
        pads, kept = (groups[:4], groups[4:]) if left else (groups[6:], groups[:6])
        assert len(set(pads)) == 4 and not set(pads) & set(kept), groups  # every pad a sequence of its own
        assert [g - kept[0] for g in kept] == [g - real[0] for g in real]  # the real sequences as they were
    ones = find_packed_sequence_indices(shapes.pad_columns(packed, 10, 1))[0].tolist()
    assert ones[5] == ones[6]  # with 1: the first pad joins the one-token sequence before it

    # Training pads a padding-free batch the same way (positions present, no mask).
    policy = ShapePolicy(buckets=(8,))
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 4]]), "position_ids": packed.clone(), "labels": packed.clone()}
    padded = pad_batch(batch, policy, pad_values_for(None, policy))
    assert padded["position_ids"][0, 6:].tolist() == [0, 0] and padded["labels"][0, 6:].tolist() == [-100, -100]


@pytest.mark.one_pair
def test_one_pad_token_choice() -> None:
    config = tiny.config("qwen3")
    config.pad_token_id = None
    assert shapes.pad_id(config, vocab=config.vocab_size) == 0  # nothing names one: any valid id does
    config.pad_token_id = config.vocab_size + 3  # not an id of this vocabulary: never used
    config.eos_token_id = [7, 8]
    assert shapes.pad_id(config, vocab=config.vocab_size) == 0
    assert shapes.pad_id(config, vocab=config.vocab_size, names=("pad_token_id", "eos_token_id")) == 7
    tok = tiny.tokenizer()
    assert shapes.pad_id(tok, config, vocab=config.vocab_size) == tok.pad_token_id  # the first source that has one
    values = shapes.pad_values(9, pad_type=2)
    assert values["input_ids"] == values["decoder_input_ids"] == 9 and values["token_type_ids"] == 2
    assert values["labels"] == -100 and values["attention_mask"] == 0


# ------------------------------------------------------------------ buckets fitted to the sizes a job sees


@pytest.fixture
def records(tmp_path, monkeypatch):
    """Shape records in a folder of this test's own (the NEFF cache folder), nothing noted or fitted before."""
    from accelerate_neuron.builtin.shapes import record

    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    record.reset()
    yield record
    record.reset()


@pytest.mark.one_pair
def test_the_fit_is_the_exact_optimum_under_its_budget() -> None:
    import itertools
    import random

    from accelerate_neuron.builtin.shapes import fit

    rng = random.Random(0)
    for _ in range(200):
        sizes = sorted(rng.sample(range(1, 80), rng.randint(1, 8)))
        histogram = {s: rng.randint(1, 9) for s in sizes}
        budget = rng.randint(1, 4)
        chosen = fit.fit(histogram, budget)
        assert len(chosen) <= budget and chosen[-1] == sizes[-1]
        best = min(
            fit.cost(histogram, (*c, sizes[-1]))
            for r in range(min(budget, len(sizes)))
            for c in itertools.combinations(sizes[:-1], r)
        )
        assert fit.cost(histogram, chosen) == best
    assert fit.pow2_budget({5: 1, 30: 2, 33: 1}) == 3  # powers of two reach 8, 32 and 64
    # As many fitted buckets as powers of two reached (128 and 512), then the powers of two beyond; a whole grid
    # (every bucket compiled) counts 512, the power of two above the largest size seen, against that budget.
    assert fit.fitted({100: 5, 300: 1}, (128, 256, 512)) == (100, 300, 512)
    assert fit.fitted({100: 5, 300: 1}, (128, 256, 512), whole_grid=True) == (300, 512)
    assert fit.fit({}, 3) == ()


@pytest.mark.one_pair
def test_fit_runs_on_pow2_without_history_then_on_the_fitted_set_saved_for_every_later_run(
    records, monkeypatch, caplog
) -> None:
    monkeypatch.setenv(PROMPT_ENV, "fit")
    key = "qwen3-0123456789abcdef"
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert shapes.resolve_policy(256, key).prompt_buckets == shapes.pow2_prompt_buckets(256)
    assert any("no sizes recorded yet" in r.getMessage() for r in caplog.records)
    for size, rows in ((5, 16), (7, 8), (9, 32), (40, 4), (41, 12), (128, 4)):
        records.note(key, "prompt_buckets", size, rows)
    assert shapes.resolve_policy(256, key).prompt_buckets == shapes.pow2_prompt_buckets(256)  # frozen for the run
    records.flush()
    path = records.root() / f"{key}.json"
    assert path.stat().st_mode & 0o077 == 0  # nobody else may write (or read) it
    records.reset()  # a new run
    fitted = shapes.resolve_policy(256, key).prompt_buckets
    # Powers of two reach 16, 64 and 128 for these sizes: three buckets, fitted, then 256 for sizes never seen (the
    # powers of two beyond the largest size seen).
    assert fitted == (9, 41, 128, 256)
    assert json.loads(path.read_text())["fitted"]["prompt_buckets"] == [9, 41, 128, 256]
    records.note(key, "prompt_buckets", 30, 1)  # a little more history: within 5% of the saved set, kept
    records.flush()
    records.reset()
    assert shapes.resolve_policy(256, key).prompt_buckets == (9, 41, 128, 256)


@pytest.mark.one_pair
def test_fit_waits_until_the_recorded_sizes_predict_the_next_ones(records, monkeypatch, caplog) -> None:
    """Sizes that fit themselves but not the job (one of each, far apart) keep pow2; a larger history of the
    same job fits. Held out: a set fitted to half the sizes, scored on the other half against powers of two."""
    import random

    from accelerate_neuron.builtin.shapes import fit

    monkeypatch.setenv(PROMPT_ENV, "fit")
    pow2 = shapes.pow2_prompt_buckets(2048)
    few = {20: 1, 40: 1, 80: 1, 160: 1, 700: 1}  # a bucket on each would fit these five and nothing near them
    assert fit.held_out(few, pow2) >= 1
    assert fit.held_out({48: 3}, pow2) < 1 and fit.held_out({48: 1}, pow2) is None
    key = "qwen3-00000000000000cc"
    for size, count in few.items():
        records.note(key, "prompt_buckets", size, count)
    records.flush()
    records.reset()
    with caplog.at_level(logging.INFO, logger="accelerate_neuron"):
        assert shapes.resolve_policy(2048, key).prompt_buckets == pow2
    said = [r.getMessage() for r in caplog.records if "do not predict each other yet" in r.getMessage()]
    assert len(said) == 1 and "5 sizes" in said[0] and "x the positions pow2 does" in said[0], said
    assert "prompt_buckets" not in json.loads((records.root() / f"{key}.json").read_text())["fitted"]
    rng = random.Random(0)  # the same job, longer: lognormal lengths around 48
    for _ in range(400):
        records.note(key, "prompt_buckets", max(4, min(2048, round(rng.lognormvariate(3.87, 1.0)))))
    records.flush()
    records.reset()
    fitted = shapes.resolve_policy(2048, key).prompt_buckets
    upcoming: dict[int, int] = {}  # sizes the job sends next, none of them recorded
    for _ in range(400):
        size = max(4, min(2048, round(rng.lognormvariate(3.87, 1.0))))
        upcoming[size] = upcoming.get(size, 0) + 1
    assert fitted != pow2 and fit.cost(upcoming, fitted) < fit.cost(upcoming, pow2)


@pytest.mark.one_pair
@pytest.mark.parametrize("damage", ["corrupt", "foreign", "mismatched", "huge size"])
def test_a_record_that_cannot_be_trusted_is_ignored_with_one_warning(records, monkeypatch, caplog, damage) -> None:
    monkeypatch.setenv(PROMPT_ENV, "fit")
    key = "qwen3-00000000000000aa"
    records.note(key, "prompt_buckets", 9, 5)
    records.flush()
    path = records.root() / f"{key}.json"
    body = json.loads(path.read_text())
    if damage == "corrupt":
        path.write_text(path.read_text()[:20])
    elif damage == "foreign":
        path.chmod(0o622)  # writable by others: another user could have put anything there
    elif damage == "mismatched":
        body["record"] = "llama-ffffffffffffffff"
        path.write_text(json.dumps(body))
    else:
        body["sizes"]["prompt_buckets"] = {"99999999999": 1}
        path.write_text(json.dumps(body))
    records.reset()
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert shapes.resolve_policy(256, key).prompt_buckets == shapes.pow2_prompt_buckets(256)
        shapes.resolve_policy(256, key)
    said = [r.getMessage() for r in caplog.records if "shape record" in r.getMessage()]
    assert len(said) == 1 and "runs on pow2" in said[0], said
    if damage == "foreign":
        records.note(key, "prompt_buckets", 9, 5)
        records.flush()  # never written to either
        assert json.loads(path.read_text()) == body


@pytest.mark.one_pair
def test_records_beside_the_graphs_leave_the_simulated_cache_its_folder(records) -> None:
    """A NEFF cache folder holding only shape records is still one the simulator may claim (it holds no NEFF)."""
    from accelerate_neuron.simulator import neff_cache

    assert records.FOLDER == neff_cache.SHAPE_RECORDS
    records.note("qwen3-0000000000000001", "prompt_buckets", 12)
    records.flush()
    cache = neff_cache.NeffCache(records.root().parent)
    assert cache.describe()["enabled"], cache.describe()


@pytest.mark.one_pair
def test_the_shape_layer_exports_what_it_lists() -> None:
    assert [name for name in shapes.__all__ if not hasattr(shapes, name)] == []


@pytest.mark.one_pair
def test_row_groups_are_the_cheapest_cuts_of_the_sorted_rows() -> None:
    """The groups' plan against every way of cutting the sorted rows into runs (each run past the first a launch,
    priced as one row of its length)."""
    import itertools
    import random

    from accelerate_neuron.builtin.shapes import groups

    prompts, batches = shapes.pow2_prompt_buckets(512), shapes.pow2_batch_buckets()
    rng = random.Random(1)
    for _ in range(60):
        extents = [rng.choice((3, 9, 20, 31, 40, 70, 130, 300)) for _ in range(rng.randint(2, 7))]
        width = prompts.at_least(max(extents))
        rows = batches.at_least(len(extents))
        ordered = sorted(extents)

        def price(cuts: tuple[int, ...], ordered: list[int] = ordered) -> int:
            bounds = [0, *cuts, len(ordered)]
            runs = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
            return sum(
                batches.at_least(b - a) * prompts.at_least(ordered[b - 1])
                + (prompts.at_least(ordered[b - 1]) if a else 0)
                for a, b in runs
            )

        best = min(price(c) for r in range(len(ordered)) for c in itertools.combinations(range(1, len(ordered)), r))
        planned = groups.plan(extents, width, prompts, batches, rows)
        if planned is None:
            assert best >= rows * width or best == price(())  # one call is no dearer
            continue
        assert sorted(r for g in planned for r in g.rows) == list(range(len(extents)))  # every row, once
        assert all(extents[r] <= g.bucket for g in planned for r in g.rows)
        cost = sum(g.padded_rows * g.bucket for g in planned) + sum(g.bucket for g in planned[1:])
        assert cost == best and best < rows * width, (extents, planned)


@pytest.mark.one_pair
def test_fit_fits_training_and_serving_buckets_from_their_own_records(records, monkeypatch) -> None:
    key = "qwen3-00000000000000bb"
    for size, rows in ((100, 18), (120, 6), (512, 3)):
        records.note(key, "train_buckets", size, rows)
        records.note(key, "serving_token_buckets", size // 4, rows)
    records.flush()
    records.reset()
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "fit")
    monkeypatch.setenv("ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS", "fit")
    # Powers of two reach 128 and 512 for 100/120/512: two buckets; the cheapest two are 120 (24 rows) and 512.
    assert tuple(resolve_policy(512, key).buckets) == (120, 512)
    served = shapes.buckets(
        "serving_token_buckets", {}, "token_buckets", lambda: shapes.pow2(16, 512, "serving_token_buckets"), record=key
    )
    assert tuple(served) == (30, 128, 256, 512)  # 25/30/128 reach 32 and 128: two buckets, then powers of two
    assert tuple(resolve_policy(512, None).buckets) != (120, 512)  # no record key (no config): pow2
