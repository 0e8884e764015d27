"""generate() on Neuron: growing tensors on the host, one compiled decode graph, results on the caller's device.

Every test runs against the 2-core simulated device of the test session and
compares with a CPU reference model (same weights, float32), or with stock
upstream (the ``unpatched`` fixture) where the point is what upstream does.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.configuration_utils import CompileConfig

from accelerate_neuron import hookimpl, patching, plugins, simulator, tiny
from accelerate_neuron.builtin.generation import cache as gcache
from helpers import REPO, clean_env

PROMPT = "the neuron core runs"
# A larger init spread than the default so greedy output is not one repeated token.
QWEN = {"initializer_range": 0.3}
T5 = {"initializer_factor": 3.0}


@pytest.fixture(scope="module", autouse=True)
def _clean_dynamo():
    """Compiled decode graphs of this module's models must not count against later tests' recompile limit."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


@pytest.fixture(scope="module")
def reference():
    return tiny.model("qwen3", **QWEN)


@pytest.fixture(scope="module")
def model():
    return tiny.model("qwen3", **QWEN).to("neuron")


def on(device, encoding):
    """A copy of ``encoding`` on ``device`` (``BatchEncoding.to`` moves in place)."""
    return {k: v.to(device) for k, v in encoding.items()}


def cache_of(output):
    cache = output.get("cache") if "cache" in output else output.get("past_key_values")
    assert cache is not None, list(output.keys())
    return cache


def cache_length(cache):
    cache = getattr(cache, "self_attention_cache", cache)
    return cache.layers[0].keys.shape[-2]


def signatures_for(model, inputs, **kwargs):
    simulator.reset_stats()
    out = model.generate(**inputs, **kwargs)
    return simulator.stats(), out


# --- the stock script: inputs.to(model.device) ------------------------------------------------------


def test_stock_inputs_on_device_match_cpu_and_come_back_on_device(sim, model, reference, tok):
    enc = tok([PROMPT], return_tensors="pt")
    expected = reference.generate(**enc, max_new_tokens=8, do_sample=False)
    out = model.generate(**on(model.device, enc), max_new_tokens=8, do_sample=False)
    assert out.device == model.device
    assert torch.equal(out.cpu(), expected)
    assert len(set(expected[0, enc["input_ids"].shape[1] :].tolist())) > 1, "degenerate reference output"


def test_eager_signatures_do_not_grow_with_max_new_tokens(sim, model, tok, unpatched):
    enc = on(model.device, tok([PROMPT], return_tensors="pt"))
    kw = {"do_sample": False, "cache_implementation": "static"}
    model.generate(**enc, max_new_tokens=2, **kw)  # warm-up: graphs and cache exist
    short, _ = signatures_for(model, enc, max_new_tokens=4, **kw)
    long, _ = signatures_for(model, enc, max_new_tokens=12, **kw)
    assert long["eager_signature_list"] == short["eager_signature_list"]
    # The default cache (no cache_implementation) is just as flat.
    default_short, _ = signatures_for(model, enc, max_new_tokens=4, do_sample=False)
    default_long, _ = signatures_for(model, enc, max_new_tokens=12, do_sample=False)
    assert default_long["eager_signatures"] == default_short["eager_signatures"]

    # Stock upstream runs the growing bookkeeping on the device: new shapes every token.
    with unpatched():
        stock_short, _ = signatures_for(model, enc, max_new_tokens=4, disable_compile=True, **kw)
        stock_long, _ = signatures_for(model, enc, max_new_tokens=12, disable_compile=True, **kw)
    assert stock_long["eager_signatures"] >= stock_short["eager_signatures"] + 8


def test_bucketing_ten_lengths_share_at_most_three_graphs(sim, reference, tok, monkeypatch):
    enc = tok([PROMPT], return_tensors="pt")
    stop = StoppingCriteriaList([StopAfter(enc["input_ids"].shape[1] + 3)])
    lengths = [3, 7, 12, 20, 28, 35, 44, 52, 61, 70]

    def graphs_for(model, lengths):
        simulator.reset_stats()
        for n in lengths:
            out = model.generate(**on(model.device, enc), max_new_tokens=n, do_sample=False, stopping_criteria=stop)
        return simulator.stats()["compiles"], out

    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    first, _ = graphs_for(fresh, lengths[:1])
    assert 1 <= first <= 2  # one static-cache generate: the decode graph (and at most one more)
    assert {g["kind"] for g in simulator.stats()["graphs"]} == {"inference"}
    # Decode inputs have fixed shapes: the compiled graph never sees the growing sequence.
    dims = [d for g in simulator.stats()["graphs"] for x in g["inputs"] for d in x.get("shape", [])]
    assert dims and all(isinstance(d, int) for d in dims)
    compiles, out = graphs_for(fresh, lengths)
    assert compiles <= 3
    assert torch.equal(out.cpu(), reference.generate(**enc, max_new_tokens=3, do_sample=False))

    # Without buckets every new length is a new cache shape, hence a new graph.
    monkeypatch.setenv(gcache.BUCKETS_ENV, "off")
    torch._dynamo.reset()
    compiles, _ = graphs_for(tiny.model("qwen3", **QWEN).to("neuron"), lengths[:2])
    assert compiles >= 2  # the same two lengths shared one bucket above


# --- static cache default, buckets -----------------------------------------------------------------


def test_static_cache_is_the_default_on_neuron_with_opt_outs(sim, model, tok, monkeypatch, caplog):
    enc = on(model.device, tok([PROMPT], return_tensors="pt"))
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = model.generate(**enc, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert type(cache_of(out)).__name__ == "StaticCache"
    assert cache_length(cache_of(out)) == 64  # 5 prompt + 5 new tokens, rounded up to the first bucket
    announced = [r for r in caplog.records if "static KV cache" in r.getMessage()]
    assert len(announced) == 1 and gcache.STATIC_CACHE_ENV in announced[0].getMessage()

    out = model.generate(
        **enc, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, cache_implementation="dynamic"
    )
    assert type(cache_of(out)).__name__ == "DynamicCache"
    monkeypatch.setenv(gcache.STATIC_CACHE_ENV, "0")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert type(cache_of(out)).__name__ == "DynamicCache"
    monkeypatch.setenv(gcache.STATIC_CACHE_ENV, "maybe")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_STATIC_CACHE='maybe'.*expected 1"):
        model.generate(**enc, max_new_tokens=5, do_sample=False)


def test_cpu_models_are_left_alone(reference, tok):
    out = reference.generate(
        **tok([PROMPT], return_tensors="pt"), max_new_tokens=5, do_sample=False, return_dict_in_generate=True
    )
    assert type(cache_of(out)).__name__ == "DynamicCache"


@pytest.mark.parametrize(
    ("spec", "requested", "max_pos", "expected"),
    [
        ("pow2", 10, 256, 64),
        ("pow2", 64, 256, 64),
        ("pow2", 65, 256, 128),
        ("pow2", 200, 256, 256),
        ("pow2", 200, 230, 230),  # never past what the model addresses
        ("pow2", 300, 256, 512),  # unless the request itself is
        ("off", 37, 256, 37),
        ("128,512", 100, None, 128),
        ("128,512", 200, None, 512),
        ("128,512", 600, None, 600),
    ],
)
def test_bucket_length(spec, requested, max_pos, expected):
    assert gcache.bucket_length(requested, max_pos, gcache.parse_buckets(spec)) == expected


@pytest.mark.parametrize("bad", ["pow3", "512,128", "0,64", "64,,128"])
def test_bad_bucket_spec_names_the_value(bad):
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_CACHE_BUCKETS=.*'pow2'"):
        gcache.parse_buckets(bad)


def test_static_cache_length_hook(sim, model, tok):
    class Plugin:
        @hookimpl
        def neuron_static_cache_length(self, requested, max_position_embeddings):
            return 1000

    enc = on(model.device, tok([PROMPT], return_tensors="pt"))
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    with plugins.registered(Plugin(), "test-cache-length"):
        out = fresh.generate(
            **enc, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, disable_compile=True
        )
    assert cache_length(cache_of(out)) == 1000


# --- where tensors live ------------------------------------------------------------------------------


def test_result_returns_on_the_callers_device(sim, model, reference, tok):
    enc = tok([PROMPT], return_tensors="pt")
    kw = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    expected = reference.generate(**enc, **kw)
    out = model.generate(**on(model.device, enc), **kw)
    assert out.sequences.device == model.device
    assert all(s.device == model.device for s in out.scores)
    assert all(torch.allclose(a.cpu(), b, atol=1e-5) for a, b in zip(out.scores, expected.scores, strict=True))
    assert cache_of(out).layers[0].keys.device == model.device  # the cache stays where the model keeps it

    host = model.generate(**enc, **kw)  # inputs left on the host come back on the host
    assert host.sequences.device.type == "cpu"
    assert torch.equal(host.sequences, expected.sequences)


def test_greedy_token_is_picked_on_device(sim, model, tok):
    """Upstream copies the whole logits row to the host every step; one id per row is enough."""
    enc = on(model.device, tok([PROMPT, "hello world , this is a tiny"], return_tensors="pt", padding=True))
    vocab = model.config.vocab_size

    def d2h_per_step():
        model.generate(**enc, max_new_tokens=2, do_sample=False)
        short, _ = signatures_for(model, enc, max_new_tokens=4, do_sample=False)
        long, _ = signatures_for(model, enc, max_new_tokens=10, do_sample=False)
        assert long["compiles"] == short["compiles"] == 0
        assert long["eager_signatures"] == short["eager_signatures"]
        return (long["d2h_bytes"] - short["d2h_bytes"]) / 6

    on_device = d2h_per_step()
    assert on_device <= 2 * 16  # one int64 id per row, plus upstream's own 8-byte reads

    class HostLogits:
        @hookimpl
        def neuron_generation_tensor_device(self, name, model_device):
            return "cpu"

    with plugins.registered(HostLogits(), "test-host-logits"):
        on_host = d2h_per_step()
    assert on_host >= 2 * vocab * 4  # the float32 row of every prompt, every step


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("sampling", {"do_sample": True, "top_k": 20}),
        ("beam search", {"num_beams": 3, "do_sample": False}),
        ("repetition penalty", {"do_sample": False, "repetition_penalty": 1.3}),
    ],
)
def test_decoding_strategies_match_cpu(sim, model, reference, tok, case, kwargs, monkeypatch):
    if case == "sampling":  # the host path: sampling on the device draws other numbers (tests/test_sampling.py)
        monkeypatch.setenv("ACCELERATE_NEURON_DEVICE_SAMPLING", "0")
    enc = tok([PROMPT], return_tensors="pt")
    torch.manual_seed(7)
    expected = reference.generate(**enc, max_new_tokens=6, **kwargs)
    torch.manual_seed(7)
    out = model.generate(**on(model.device, enc), max_new_tokens=6, **kwargs)
    assert out.device == model.device
    assert torch.equal(out.cpu(), expected), case


def test_beam_search_signatures_do_not_grow(sim, model, tok):
    enc = on(model.device, tok([PROMPT], return_tensors="pt"))
    model.generate(**enc, max_new_tokens=2, num_beams=3, do_sample=False)
    short, _ = signatures_for(model, enc, max_new_tokens=4, num_beams=3, do_sample=False)
    long, _ = signatures_for(model, enc, max_new_tokens=10, num_beams=3, do_sample=False)
    assert long["eager_signatures"] == short["eager_signatures"]


def test_batched_left_padded_prompts_match_cpu(sim, model, reference, tok):
    enc = tok([PROMPT, "hello world , this is a tiny model"], return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, 0] == 0).any(), "expected left padding"
    expected = reference.generate(**enc, max_new_tokens=6, do_sample=False)
    out = model.generate(**on(model.device, enc), max_new_tokens=6, do_sample=False)
    assert torch.equal(out.cpu(), expected)


def test_streamer_and_stopping_criteria(sim, model, reference, tok):
    seen_devices = set()

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen_devices.add(input_ids.device.type)
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    enc = tok([PROMPT], return_tensors="pt")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        out = model.generate(
            **on(model.device, enc),
            max_new_tokens=20,
            do_sample=False,
            streamer=TextStreamer(tok),
            stopping_criteria=StoppingCriteriaList([StopAt()]),
        )
    assert out.shape[1] == 9
    assert seen_devices == {"cpu"}  # criteria see the host-side sequence
    expected = reference.generate(**enc, max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), expected)
    assert buffer.getvalue().strip() == tok.decode(expected[0]).strip()


def test_encoder_decoder_t5(sim, tok):
    reference = tiny.model("t5", **T5)
    t5 = tiny.model("t5", **T5).to("neuron")
    enc = tok([PROMPT], return_tensors="pt")
    expected = reference.generate(**enc, max_new_tokens=6, do_sample=False)
    t5.generate(**on(t5.device, enc), max_new_tokens=2, do_sample=False)
    short, out = signatures_for(t5, on(t5.device, enc), max_new_tokens=6, do_sample=False)
    assert out.device == t5.device
    assert torch.equal(out.cpu(), expected)
    assert len(set(expected[0].tolist())) > 2, "degenerate reference output"
    long, _ = signatures_for(t5, on(t5.device, enc), max_new_tokens=14, do_sample=False)
    assert long["eager_signatures"] == short["eager_signatures"]
    assert long["compiles"] == 0


def test_text_generation_pipeline_on_neuron(sim, model, reference, tok):
    stock = transformers.pipeline("text-generation", model=reference, tokenizer=tok, device="cpu")
    expected = stock(PROMPT, max_new_tokens=5, do_sample=False)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="neuron")
    assert pipe.model.device.type == "neuron"
    assert pipe(PROMPT, max_new_tokens=5, do_sample=False) == expected


def test_model_split_across_cores_decodes_eagerly_with_flat_shapes(sim, reference, tok, monkeypatch, caplog):
    """Regions off (compiled per layer by default: test_regions.py): a split model decodes eagerly."""
    from accelerate import dispatch_model

    monkeypatch.setenv("ACCELERATE_NEURON_COMPILE_REGIONS", "off")

    device_map = {
        "model.embed_tokens": 0,
        "lm_head": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
    }
    split = dispatch_model(tiny.model("qwen3", **QWEN), device_map)
    assert {p.device.index for p in split.parameters()} == {0, 1}
    enc = tok([PROMPT], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        split.generate(**on(split.device, enc), max_new_tokens=2, do_sample=False)
    assert any("several Neuron cores" in r.getMessage() for r in caplog.records)
    short, out = signatures_for(split, on(split.device, enc), max_new_tokens=4, do_sample=False)
    long, _ = signatures_for(split, on(split.device, enc), max_new_tokens=10, do_sample=False)
    # One compiled graph would hold tensors of two cores (a NEFF runs on one core): decode runs eagerly.
    assert short["compiles"] == long["compiles"] == 0
    assert long["eager_signatures"] == short["eager_signatures"]
    assert out.device == split.device
    assert torch.equal(out.cpu(), reference.generate(**enc, max_new_tokens=4, do_sample=False))


def test_inputs_embeds_assisted_decoding_and_kwarg_validation(sim, model, reference, tok):
    enc = tok([PROMPT], return_tensors="pt")
    dev = on(model.device, enc)
    # Upstream reads prepare_inputs_for_generation's signature (inputs_embeds support, kwarg validation):
    # the per-call wrapper must keep it.
    with torch.no_grad():
        embeds = model.get_input_embeddings()(dev["input_ids"])
        expected = reference.generate(
            inputs_embeds=reference.get_input_embeddings()(enc["input_ids"]),
            attention_mask=enc["attention_mask"],
            max_new_tokens=4,
            do_sample=False,
        )
    out = model.generate(inputs_embeds=embeds, attention_mask=dev["attention_mask"], max_new_tokens=4, do_sample=False)
    assert out.device == model.device and torch.equal(out.cpu(), expected)
    with pytest.raises(ValueError, match="max_new_tokns"):
        model.generate(**dev, max_new_tokns=4)

    # Assisted decoding (a draft on the host, the target on Neuron): the result comes back on the caller's device.
    assistant = tiny.model("qwen3", seed=1, **QWEN)
    expected = reference.generate(**enc, max_new_tokens=6, do_sample=False, assistant_model=assistant)
    out = model.generate(**dev, max_new_tokens=6, do_sample=False, assistant_model=assistant.to("neuron"))
    assert out.device == model.device and torch.equal(out.cpu(), expected)


class _OwnInputs(transformers.Qwen3ForCausalLM):
    """A model whose ``prepare_inputs_for_generation`` never calls the shared one (like 102 models in 4.57)."""

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}


@pytest.mark.filterwarnings("ignore:You are calling .generate:UserWarning")  # stock 4.x, in the unpatched block
def test_models_with_their_own_prepare_inputs(sim, tok, unpatched):
    torch.manual_seed(0)
    reference = _OwnInputs(tiny.config("qwen3", **QWEN)).eval()
    neuron_model = _OwnInputs(tiny.config("qwen3", **QWEN)).eval()
    neuron_model.load_state_dict(reference.state_dict())
    neuron_model.to("neuron")
    enc = tok([PROMPT], return_tensors="pt")
    expected = reference.generate(**enc, max_new_tokens=5, do_sample=False, use_cache=False)
    out = neuron_model.generate(**enc, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(out, expected)
    assert "prepare_inputs_for_generation" not in neuron_model.__dict__  # the per-call wrapper is gone
    with unpatched(), pytest.raises(RuntimeError, match="same device"):
        neuron_model.generate(**enc, max_new_tokens=5, do_sample=False, use_cache=False)


def test_status_reports_the_generation_patches():
    from accelerate_neuron.builtin import generation

    # apply() is idempotent: it returns the record of an applied patch, and re-records a skip.
    records = {p.key: patching.apply(p, plugin="generation") for p in generation.neuron_patches()}
    applied = {k for k, r in records.items() if r.status == "applied"}
    for key in (
        "transformers.generation.utils.GenerationMixin.generate",
        "transformers.generation.utils.GenerationMixin._prepare_cache_for_generation",
        "transformers.generation.utils.GenerationMixin._valid_auto_compile_criteria",
        "transformers.generation.utils.GenerationMixin._sample",
        "transformers.modeling_utils.PreTrainedModel.get_compiled_call",
    ):
        assert key in applied, (key, records.get(key))
    # Exactly one spelling of each renamed upstream helper exists in a release.
    for family in ("generation.static_cache_length", "generation.encoder_inputs"):
        pair = [r for k, r in records.items() if k.startswith(family)]
        assert sorted(r.status for r in pair) == ["applied", "skipped"], pair
        skipped = next(r for r in pair if r.status == "skipped")
        assert "does not exist" in skipped.detail


# --- compiled graphs (last: they reset Dynamo, which the shared model would pay for again) -------------


class StopAfter(StoppingCriteria):
    """Stop at ``length`` tokens: the cache is sized by ``max_new_tokens``, the test time by this."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_disable_compile_and_user_compile_config_are_honoured(sim, tok):
    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    enc = on(fresh.device, tok([PROMPT], return_tensors="pt"))
    stats, _ = signatures_for(fresh, enc, max_new_tokens=4, do_sample=False, disable_compile=True)
    assert stats["compiles"] == 0

    seen = []

    def user_backend(gm, example_inputs):
        seen.append(len(example_inputs))
        return gm.forward

    config = CompileConfig(backend=user_backend, mode="default", dynamic=False)
    stats, _ = signatures_for(fresh, enc, max_new_tokens=4, do_sample=False, compile_config=config)
    assert seen, "the caller's compile_config was not used"
    assert stats["compiles"] == 0  # nothing went to the "neuron" backend
    assert config._compile_all_devices is None  # the caller's object is left as they made it


def test_compile_config_hook_sets_the_default(sim, tok):
    class Plugin:
        @hookimpl
        def neuron_compile_config(self, purpose):
            return {"backend": "eager", "dynamic": False} if purpose == "generate" else None

    torch._dynamo.reset()
    fresh = tiny.model("qwen3", **QWEN).to("neuron")
    enc = on(fresh.device, tok([PROMPT], return_tensors="pt"))
    with plugins.registered(Plugin(), "test-compile-config"):
        stats, _ = signatures_for(fresh, enc, max_new_tokens=4, do_sample=False)
    assert stats["compiles"] == 0
    assert fresh._last_compile_config.backend == "eager"


# --- the example script, unchanged, in a fresh interpreter ---------------------------------------------


def test_example_qwen3_script_runs_unchanged(tmp_path):
    folder = tiny.save_pretrained(tmp_path / "tiny-qwen3", "qwen3", **QWEN)
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "qwen3_generate.py")],
        env=clean_env(MODEL_ID=str(folder), ACCELERATE_NEURON_SIMULATE="1", MAX_NEW_TOKENS="8"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr
    assert "model device: neuron:0" in proc.stdout, proc.stdout + proc.stderr
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok(["Give me a short introduction to large language models."], return_tensors="pt")
    ids = reference.generate(**prompt, max_new_tokens=8)[0, prompt["input_ids"].shape[1] :]
    assert proc.stdout.rstrip("\n").endswith("content: " + tok.decode(ids, skip_special_tokens=True))
