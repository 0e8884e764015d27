"""Speculative decoding on Neuron: assisted generation and prompt lookup at bounded shapes (issue 40).

A stock script asking ``generate()`` for ``assistant_model=`` or ``prompt_lookup_num_tokens=``, prompts of several
lengths one by one. Upstream crops a dynamic cache every round and keeps the sequence on the device: hundreds of
new eager signatures per prompt length. With the plugin the target's verification forward and the draft's
forwards are compiled at a few widths on static caches rolled back by position: the graphs are the (width, cache
length) pairs the buckets allow, eager signatures stop growing, and the tokens are the CPU's (greedy: the same
tokens as plain greedy decoding).
"""

# ruff: noqa: F811 - the fixtures imported from test_generation are parameters of the tests below

from __future__ import annotations

import logging

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import settings, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.generation import widths
from test_generation import QWEN, _clean_dynamo, on, tok  # noqa: F401 - shared fixtures
from test_generation_buckets import prompt

NEW = 8
CANDIDATES = 4


def _draft(target: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``target`` with its weights nudged: it agrees with the target on some candidates, not all."""
    draft = tiny.model("qwen3", **QWEN)
    draft.load_state_dict(target.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    # Upstream reads the candidate count from the draft's generation config (not from generate()'s arguments).
    draft.generation_config.num_assistant_tokens = CANDIDATES
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


def _allowed_widths(model: torch.nn.Module, fixed: int | None) -> set[int]:
    w = widths.widths_for(shapes.max_positions(model), fixed)
    return {1, *w.prompt, *(1 + c for c in w.candidates)}


def _graphs(stats: dict, compiled_only: bool = False) -> list[tuple[int, int, int]]:
    """(vocabulary, width, cache length) of every graph traced: the model's embedding rows (target or draft), its
    ``input_ids`` columns, its 2D mask's columns (the cache's). ``compiled_only``: NEFF cache misses only (a graph
    another model of the same architecture compiled first is a hit: nothing compiled on Neuron)."""
    found = []
    for graph in stats["graphs"]:
        if compiled_only and graph.get("cache") == "hit":
            continue
        inputs = {x["name"]: x["shape"] for x in graph["dynamo_inputs"]}
        ids = next(v for k, v in inputs.items() if k.endswith("['input_ids']"))
        mask = next(v for k, v in inputs.items() if k.endswith("['attention_mask']"))
        embed = next(v for k, v in inputs.items() if "embed_tokens" in k)
        assert ids[0] == 1 and len(mask) == 2, inputs
        found.append((embed[0], ids[1], mask[1]))
    return found


def _generate_counted(sim, model, enc, calls: list, **kwargs) -> torch.Tensor:
    """``model.generate`` with the eager signatures it added and the cache lengths its new graphs hold."""
    before, graphs = sim.stats()["eager_signatures"], len(sim.stats()["graphs"])
    kwargs.setdefault("do_sample", False)
    out = model.generate(**on(model.device, enc), max_new_tokens=NEW, **kwargs)
    stats = sim.stats()
    calls.append((stats["eager_signatures"] - before, {kv for *_, kv in _graphs({"graphs": stats["graphs"][graphs:]})}))
    return out


def _check_bounded(sim, calls: list, allowed: set[int]) -> None:
    """After the first call, a prompt length adds no eager signature unless a new cache length appears (then its
    allocation only, as for plain generate()); every graph at an allowed width, none compiled twice."""
    seen = set(calls[0][1])
    for added, lengths in calls[1:]:
        assert added <= 4 * len(lengths - seen), calls
        seen |= lengths
    assert all(width in allowed for _, width, _ in _graphs(sim.stats())), (_graphs(sim.stats()), allowed)
    compiled = _graphs(sim.stats(), compiled_only=True)
    assert len(compiled) == len(set(compiled)), compiled


def test_assisted_generation_is_bounded_and_greedy_tokens_match_cpu(sim, tok, caplog):
    caplog.set_level(logging.DEBUG, logger="accelerate_neuron.builtin.generation.speculation")
    reference = tiny.model("qwen3", **QWEN)
    draft_cpu = _draft(reference, noise=0.1)
    model = tiny.model("qwen3", **QWEN).to("neuron")
    draft = _draft(tiny.model("qwen3", **QWEN), noise=0.1).to("neuron")
    accelerate_neuron.reset_speculation_stats()
    calls: list = []
    for words in (3, 5, 7, 9, 11):
        enc = tok(prompt(words), return_tensors="pt")
        out = _generate_counted(sim, model, enc, calls, assistant_model=draft)
        assert out.device == model.device
        expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out.cpu(), expected), words
        stock_assisted = reference.generate(**enc, do_sample=False, max_new_tokens=NEW, assistant_model=draft_cpu)
        assert torch.equal(out.cpu(), stock_assisted), words
    _check_bounded(sim, calls, _allowed_widths(model, CANDIDATES))
    figures = accelerate_neuron.speculation_stats()
    assert figures["calls"] == 5 and figures["tokens"] == 5 * NEW, figures
    # The nudged draft agrees on some candidates, not all: rollback by position is exercised both ways.
    assert 0 < figures["accepted"] < figures["candidates"], figures
    assert figures["forwards_per_token"] < 1.0, figures
    assert figures["draft_forwards"] > 0, figures
    said = [r.getMessage() for r in caplog.records if "speculative generate()" in r.getMessage()]
    assert len(said) == 5 and f"for {NEW} tokens" in said[0] and "candidates accepted" in said[0], said

    # Speculative sampling: the draft's and the target's rows reach upstream's acceptance step on the host, so with
    # one seed the tokens are the CPU's, on the graphs compiled above.
    enc = tok(prompt(9), return_tensors="pt")
    compiled = len(sim.stats()["graphs"])
    torch.manual_seed(5)
    sampled = _generate_counted(sim, model, enc, calls, assistant_model=draft, do_sample=True)
    torch.manual_seed(5)
    expected = reference.generate(**enc, do_sample=True, max_new_tokens=NEW, assistant_model=draft_cpu)
    assert torch.equal(sampled.cpu(), expected)
    assert calls[-1][0] == 0 and len(sim.stats()["graphs"]) == compiled, calls[-1]


def test_prompt_lookup_is_bounded_and_greedy_tokens_match_cpu(sim, tok):
    reference = tiny.model("qwen3", **QWEN)
    model = tiny.model("qwen3", **QWEN).to("neuron")
    accelerate_neuron.reset_speculation_stats()
    calls: list = []
    for words in (3, 5, 7, 9, 11):
        text = prompt(words)
        enc = tok(f"{text} {text}", return_tensors="pt")
        out = _generate_counted(sim, model, enc, calls, prompt_lookup_num_tokens=3)
        expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out.cpu(), expected), words
    _check_bounded(sim, calls, _allowed_widths(model, 3))
    figures = accelerate_neuron.speculation_stats()
    assert figures["calls"] == 5 and figures["draft_forwards"] == 0, figures
    assert figures["target_forwards"] <= figures["tokens"], figures


def test_universal_assisted_decoding_is_bounded_and_greedy_tokens_match_cpu(sim, tok):
    """A draft with another tokenizer: the re-tokenization stays on the host, the draft's forwards on its runner."""
    draft_tok = tiny.tokenizer(vocab_size=300)
    draft_config = {**QWEN, "vocab_size": 300, "num_hidden_layers": 1}
    reference = tiny.model("qwen3", **QWEN)
    draft_cpu = tiny.model("qwen3", seed=3, **draft_config)
    draft_cpu.generation_config.num_assistant_tokens = CANDIDATES
    draft_cpu.generation_config.num_assistant_tokens_schedule = "constant"
    enc = tok(prompt(3), return_tensors="pt")
    universal = {"tokenizer": tok, "assistant_tokenizer": draft_tok}
    try:
        reference.generate(**enc, do_sample=False, max_new_tokens=NEW, assistant_model=draft_cpu, **universal)
    except (RuntimeError, IndexError) as exc:
        pytest.xfail(f"upstream's universal assisted decoding fails on the CPU in this release: {exc}")
    model = tiny.model("qwen3", **QWEN).to("neuron")
    draft = tiny.model("qwen3", seed=3, **draft_config).to("neuron")
    draft.generation_config = draft_cpu.generation_config
    accelerate_neuron.reset_speculation_stats()
    calls: list = []
    for words in (3, 5, 7, 9):
        enc = tok(prompt(words), return_tensors="pt")
        out = _generate_counted(sim, model, enc, calls, assistant_model=draft, **universal)
        expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out.cpu(), expected), words
    _check_bounded(sim, calls, _allowed_widths(model, CANDIDATES))
    figures = accelerate_neuron.speculation_stats()
    assert figures["calls"] == 4 and figures["draft_forwards"] > 0, figures


@pytest.mark.one_pair
def test_speculation_off_runs_upstreams_loop_with_the_same_tokens(tok, monkeypatch):
    monkeypatch.setenv(settings.env_name("speculation"), "0")
    reference = tiny.model("qwen3", **QWEN)
    model = tiny.model("qwen3", **QWEN).to("neuron")
    accelerate_neuron.reset_speculation_stats()
    enc = tok(prompt(5), return_tensors="pt")
    out = model.generate(**on(model.device, enc), do_sample=False, max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert out.device == model.device
    assert torch.equal(out.cpu(), reference.generate(**enc, do_sample=False, max_new_tokens=4))
    assert accelerate_neuron.speculation_stats()["calls"] == 0


@pytest.mark.one_pair
def test_simulate_report_sums_acceptance_over_processes():
    from accelerate_neuron.cli import _dryrun, _render

    one = {"calls": 2, "target_forwards": 6, "draft_forwards": 9, "candidates": 12, "accepted": 6, "tokens": 12}
    other = {"calls": 1, "target_forwards": 4, "draft_forwards": 4, "candidates": 4, "accepted": 0, "tokens": 4}
    merged = _dryrun.speculation([{"speculation": one}, {"speculation": other}, {}])
    assert merged["calls"] == 3 and merged["tokens"] == 16 and merged["forwards_per_token"] == 0.625, merged
    assert merged["accepted_per_forward"] == 0.6, merged
    text = "\n".join(_render._speculation({"speculation": merged}))
    assert "16 tokens in 10 target forwards (0.62 per token)" in text, text
    assert _dryrun.speculation([{"speculation": {}}]) is None
    rejected = _dryrun.speculation([{"speculation": other}])
    assert "a closer draft" in "\n".join(_render._speculation({"speculation": rejected}))
