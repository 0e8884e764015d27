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

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import settings, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.generation import widths
from test_generation import QWEN, _clean_dynamo, on, tok  # noqa: F401 - shared fixtures
from test_generation_buckets import prompt

NEW = 12
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


def _graphs(stats: dict) -> list[tuple[int, int]]:
    """(width, cache length) of every graph compiled: its ``input_ids`` columns, its 2D mask's (the cache's)."""
    found = []
    for graph in stats["graphs"]:
        inputs = {x["name"]: x["shape"] for x in graph["dynamo_inputs"]}
        ids = next(v for k, v in inputs.items() if k.endswith("['input_ids']"))
        mask = next(v for k, v in inputs.items() if k.endswith("['attention_mask']"))
        assert ids[0] == 1 and len(mask) == 2, inputs
        found.append((ids[1], mask[1]))
    return found


def _generate_counted(sim, model, enc, calls: list, **kwargs) -> torch.Tensor:
    """``model.generate`` with the eager signatures it added and the cache lengths its new graphs hold."""
    before, graphs = sim.stats()["eager_signatures"], len(sim.stats()["graphs"])
    out = model.generate(**on(model.device, enc), do_sample=False, max_new_tokens=NEW, **kwargs)
    stats = sim.stats()
    calls.append((stats["eager_signatures"] - before, {kv for _, kv in _graphs({"graphs": stats["graphs"][graphs:]})}))
    return out


def _check_bounded(sim, calls: list, allowed: set[int]) -> None:
    """After the first call, a prompt length adds no eager signature unless a new cache length appears (then its
    allocation only, as for plain generate()); every graph at an allowed width, none compiled twice."""
    seen = set(calls[0][1])
    for added, lengths in calls[1:]:
        assert added <= 4 * len(lengths - seen), calls
        seen |= lengths
    found = _graphs(sim.stats())
    assert all(width in allowed for width, _ in found), (found, allowed)
    assert len(found) == len(set(found)), found


def test_assisted_generation_is_bounded_and_greedy_tokens_match_cpu(sim, tok):
    reference = tiny.model("qwen3", **QWEN)
    draft_cpu = _draft(reference, noise=0.1)
    model = tiny.model("qwen3", **QWEN).to("neuron")
    draft = _draft(tiny.model("qwen3", **QWEN), noise=0.1).to("neuron")
    accelerate_neuron.reset_speculation_stats()
    calls: list = []
    for words in (3, 7, 11, 15, 19):
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


def test_prompt_lookup_is_bounded_and_greedy_tokens_match_cpu(sim, tok):
    reference = tiny.model("qwen3", **QWEN)
    model = tiny.model("qwen3", **QWEN).to("neuron")
    accelerate_neuron.reset_speculation_stats()
    calls: list = []
    for words in (3, 7, 11, 15, 19):
        text = prompt(words)
        enc = tok(f"{text} {text}", return_tensors="pt")
        out = _generate_counted(sim, model, enc, calls, prompt_lookup_num_tokens=3)
        expected = reference.generate(**enc, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out.cpu(), expected), words
    _check_bounded(sim, calls, _allowed_widths(model, 3))
    figures = accelerate_neuron.speculation_stats()
    assert figures["calls"] == 5 and figures["draft_forwards"] == 0, figures
    assert figures["target_forwards"] <= figures["tokens"], figures


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
