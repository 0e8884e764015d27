"""Regional compilation: a model split over Neuron cores by ``device_map="auto"`` generates compiled, layer by layer.

A NEFF runs on one core, so a model spread over two cores cannot be one graph.
Each decoder layer is compiled on its own (the ``regions`` plugin), on the core
holding its weights; identical layers share one graph per shape. The tiny
models are saved and loaded back with ``device_map="auto"`` and a ``max_memory``
that forces the split, the way a user's too-large model is. Tokens are compared
with the CPU reference (greedy, float32).

Simulator fidelity: the NEFF cache key keys devices by type (a NEFF loads on any
core), so the same layer graph on core 1 is a cache hit; Dynamo traces each
layer again (its index is a constant of the graph), which on Trainium costs a
trace and a cache load per layer and shape, not a compile (docs/fidelity.md).
"""

# ruff: noqa: F811 - the fixtures imported from test_generation are parameters of the tests below

from __future__ import annotations

import pytest
import torch
import transformers

from accelerate_neuron import simulator, tiny
from accelerate_neuron.cli._dryrun import graphs_by_region
from accelerate_neuron.simulator import neff_cache
from helpers import last_json, run_python
from test_generation import QWEN, _clean_dynamo, tok  # noqa: F401 - shared fixtures

WORDS = tiny.CORPUS.split()
NEW = 6


def _prompt(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def _split_over_two_cores(tmp_path, layers: int):
    """A tiny Qwen3 of ``layers`` layers loaded with device_map="auto" and a max_memory that fills core 0 early."""
    cpu = tiny.model("qwen3", num_hidden_layers=layers, **QWEN)
    cpu.save_pretrained(tmp_path / f"q{layers}")
    size = sum(p.numel() * p.element_size() for p in cpu.parameters())
    layer = sum(p.numel() * p.element_size() for p in cpu.model.layers[0].parameters())
    # Accelerate keeps room for the largest layer on every core but the last: core 0 holds about half the model.
    budget = {0: int(size * 0.6) + layer, 1: "1GiB"}
    split = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / f"q{layers}", device_map="auto", max_memory=budget, dtype=torch.float32
    )
    return cpu, split


#: Varied prompts: three lengths in one prompt bucket, one in the next, a batch of 3 rows.
JOB = ((12, 1), (14, 1), (18, 1), (40, 1), (13, 3))


def _job(model, cpu, tok, calls=JOB):
    """``generate()`` for (words, rows) prompts; every result equal to the CPU's tokens."""
    for words, rows in calls:
        enc = tok([_prompt(words + r, offset=r) for r in range(rows)], return_tensors="pt", padding=True)
        out = model.generate(**{k: v.to(model.device) for k, v in enc.items()}, max_new_tokens=NEW, do_sample=False)
        expected = cpu.generate(**enc, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out.cpu(), expected), (words, rows)


def _graph_devices(stats) -> list[set[str]]:
    return [{x["device"] for x in g["inputs"] if x.get("device", "cpu") != "cpu"} for g in stats["graphs"]]


def test_split_model_generates_compiled_per_layer_and_graphs_do_not_grow_with_depth(sim, tok, tmp_path, monkeypatch):
    # One cache length for every call: upstream keeps a larger cache from an earlier call, so with several cache
    # buckets the shapes a call sees depend on the calls before it (the same with or without regions).
    monkeypatch.setenv("ACCELERATE_NEURON_CACHE_BUCKETS", "256")
    figures = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        cpu, split = _split_over_two_cores(tmp_path, layers)
        cores = {str(d) for d in split.hf_device_map.values()}
        assert cores == {"0", "1"}, split.hf_device_map
        layer_cores = {str(p.device) for layer in split.model.layers for p in layer.parameters()}
        # "auto" balances: 2 layers go to core 1 (the embeddings fill core 0), 4 layers to both cores.
        assert layer_cores == ({"neuron:1"} if layers == 2 else {"neuron:0", "neuron:1"}), split.hf_device_map
        with neff_cache.temporary():  # each model on its own cold cache: what it compiles alone
            simulator.reset_stats()
            _job(split, cpu, tok)
            first = simulator.stats()
            if layers == 2:  # the same job again: nothing new to compile, no eager op of a new shape
                _job(split, cpu, tok)
                again = simulator.stats()
                assert again["compiles"] == first["compiles"]
                assert again["eager_signatures"] == first["eager_signatures"]
        figures[layers] = first
        # Every graph runs on one core, and layers of both cores ran compiled.
        devices = _graph_devices(first)
        assert all(len(d) == 1 for d in devices), devices
        assert set().union(*devices) == layer_cores
        # A shape is compiled once; every other layer (on either core) loads it from the NEFF cache.
        assert first["compile_cache_hits"] == first["compiles"] * (layers - 1)
        assert first["dynamo_graphs"] == first["compiles"] * layers
        # What `accelerate-neuron simulate` reports: graphs per compiled function (the layer's forward) and core.
        regions = graphs_by_region([{"stats": first}])
        assert {r["core"] for r in regions} == layer_cores
        assert len({r["function"] for r in regions}) == 1  # one compiled function, the layer class's forward
        assert sum(r["compiled"] for r in regions) == 5 and sum(r["loaded"] for r in regions) == 5 * (layers - 1)
        # The plain forwards are back after the call: the model stays as the user loaded it.
        assert all("forward" not in layer.__dict__ or "_old_forward" in layer.__dict__ for layer in split.model.layers)
        assert all(not getattr(layer._old_forward, "_accelerate_neuron_region", False) for layer in split.model.layers)
    two, four = figures[2], figures[4]
    # Graphs bounded by the buckets touched and NOT growing with depth: prefill (rows, prompt bucket) of (1, 32),
    # (1, 128) and (4, 32) (3 rows -> batch bucket 4), and decode (1, 1) and (4, 1), each over 256 cache positions.
    shapes = {tuple(x["shape"][:2]) for g in two["graphs"] for x in g["dynamo_inputs"][:1]}
    # (Transformers 4.x prefills all but the prompt's last token in its chunked path: bucket - 1 columns.)
    assert shapes in (
        {(1, 32), (1, 128), (4, 32), (1, 1), (4, 1)},
        {(1, 31), (1, 127), (4, 31), (1, 1), (4, 1)},
    ), shapes
    assert two["compiles"] == four["compiles"] == 5
    assert two["eager_signatures"] == four["eager_signatures"]  # the eager part (embeddings, mask, head) is flat


def test_rows_of_very_different_lengths_on_a_split_model_prefill_in_groups(sim, tok, tmp_path):
    """A group's keys and values go into each layer's cache on that layer's core (4.57 once copied them with an
    index on the first core), and the tokens are the CPU's."""
    import accelerate_neuron

    torch._dynamo.reset()
    cpu, split = _split_over_two_cores(tmp_path, 2)
    accelerate_neuron.reset_padding_stats()
    enc = tok([_prompt(60), _prompt(3, offset=1), _prompt(4, offset=2)], return_tensors="pt", padding=True)
    out = split.generate(**{k: v.to(split.device) for k, v in enc.items()}, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out.cpu(), cpu.generate(**enc, max_new_tokens=NEW, do_sample=False))
    computed = accelerate_neuron.padding_stats()["generate_prefill"]["computed"]
    assert computed < 4 * enc["input_ids"].shape[1], computed  # grouped: not 4 rows (3 + a dummy) at the long bucket


def test_regions_setting_off_layers_and_auto(sim, tok, tmp_path, monkeypatch):
    """off: the split model runs eagerly (no graph); layers on one core: the CPU's tokens, one graph per shape."""
    torch._dynamo.reset()
    cpu, split = _split_over_two_cores(tmp_path, 2)
    monkeypatch.setenv("ACCELERATE_NEURON_COMPILE_REGIONS", "off")
    simulator.reset_stats()
    _job(split, cpu, tok, JOB[:2])
    assert simulator.stats()["compiles"] == 0 and simulator.stats()["compile_cache_hits"] == 0
    one_core = cpu.to("neuron")  # the same weights on one core
    reference = tiny.model("qwen3", num_hidden_layers=2, **QWEN)
    per_mode = {}
    for mode in ("auto", "layers"):
        monkeypatch.setenv("ACCELERATE_NEURON_COMPILE_REGIONS", mode)
        torch._dynamo.reset()
        simulator.reset_stats()
        _job(one_core, reference, tok, JOB[:2])
        per_mode[mode] = simulator.stats()
    whole, layers = per_mode["auto"], per_mode["layers"]
    assert whole["compile_cache_hits"] == 0  # auto on one core: the whole model, one graph per shape
    assert layers["compiles"] == whole["compiles"]  # layers: one layer graph per shape instead
    assert layers["compile_cache_hits"] == layers["compiles"]  # the second layer loads it
    monkeypatch.setenv("ACCELERATE_NEURON_COMPILE_REGIONS", "everything")
    with pytest.raises(ValueError, match="ACCELERATE_NEURON_COMPILE_REGIONS='everything'"):
        one_core.generate(**tok([_prompt(3)], return_tensors="pt"), max_new_tokens=2)


def test_four_layers_over_four_cores_in_a_child():
    """Four simulated cores (a child process): layers on several cores, the CPU's tokens, one graph per shape."""
    proc = run_python(
        f"""
        import json, tempfile, torch, transformers
        from accelerate_neuron import simulator, tiny
        cpu = tiny.model("qwen3", num_hidden_layers=4, **{QWEN!r})
        folder = tempfile.mkdtemp()
        cpu.save_pretrained(folder)
        size = sum(p.numel() * p.element_size() for p in cpu.parameters())
        layer = sum(p.numel() * p.element_size() for p in cpu.model.layers[0].parameters())
        budget = {{i: int(size * 0.3) + layer for i in range(4)}}
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=budget)
        tok = tiny.tokenizer()
        simulator.reset_stats()
        same = []
        for words in ("the neuron core", "the neuron core runs the compiled graph ."):
            enc = tok([words], return_tensors="pt")
            out = model.generate(**enc.to(model.device), max_new_tokens=4, do_sample=False)
            same.append(torch.equal(out.cpu(), cpu.generate(**enc.to("cpu"), max_new_tokens=4, do_sample=False)))
        stats = simulator.stats()
        cores = sorted({{str(p.device) for layer in model.model.layers for p in layer.parameters()}})
        spans = sorted({{str(d) for d in model.hf_device_map.values()}})
        print(json.dumps({{"same": same, "cores": cores, "spans": spans, "compiles": stats["compiles"],
                          "hits": stats["compile_cache_hits"]}}))
        """,
        ACCELERATE_NEURON_SIMULATE="4",
    )
    result = last_json(proc.stdout)
    assert result["same"] == [True, True]
    assert len(result["spans"]) >= 3 and len(result["cores"]) >= 2, result  # the model over 3+ cores, layers on 2+
    assert result["compiles"] == 2 and result["hits"] == 2 * 3, result  # prefill + decode, once for four layers


def test_inference_call_of_a_split_model_runs_its_layers_compiled_and_training_stays_eager(sim, tok, tmp_path):
    torch._dynamo.reset()
    cpu, split = _split_over_two_cores(tmp_path, 4)
    enc = tok([_prompt(5), _prompt(9, offset=2)], return_tensors="pt", padding=True)
    simulator.reset_stats()
    with torch.no_grad():
        got = split(**{k: v.to(split.device) for k, v in enc.items()}).logits
        want = cpu(**enc).logits
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)  # bucketed (padded) call: float rounding
    stats = simulator.stats()
    assert stats["compiles"] == 1 and stats["compile_cache_hits"] == 3  # one layer graph, loaded by three layers
    # Training (gradients on) never enters a region: the split model's step runs eagerly, as documented.
    split.train()
    simulator.reset_stats()
    split(**{k: v.to(split.device) for k, v in enc.items()}, labels=enc["input_ids"].to(split.device)).loss.backward()
    assert simulator.stats()["compiles"] == 0 and simulator.stats()["compile_cache_hits"] == 0
    assert all(p.grad is not None for p in split.model.layers[0].parameters())
