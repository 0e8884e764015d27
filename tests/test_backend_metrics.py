"""The backend's own metrics (compile records, NEFF cache counters, CPU fallbacks) and the CPU fallback model.

The simulated device answers torch-neuronx's metric functions with the same names and result shapes;
``accelerate_neuron.backend_metrics`` reads them as it would on Trainium. The demo's and the dry-run
report's use of them are tested in test_cli.py; the recompile watchdog's in test_training.py.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import backend_metrics
from accelerate_neuron.simulator import cpu_fallback, device_module
from helpers import REPO, clean_env, last_json, run_python

# The simulator's stand-in for torch-neuronx (there is no real one here), as a user's script imports it.
torch_neuronx = importlib.import_module("torch_neuronx")
importlib.import_module("torch_neuronx.metrics")

EXPERT_IDS = [3, 0, 1, 1, 3, 2, 1, 0, 3, 3, 1, 2]


@pytest.fixture
def fallback_ops() -> Any:
    """Lets a test choose which ops run on the host; the configured set comes back afterwards."""
    previous = cpu_fallback.ops()
    yield cpu_fallback.set_ops
    cpu_fallback.set_ops(previous)


def _int_histc() -> torch.Tensor:
    ids = torch.tensor(EXPERT_IDS, dtype=torch.int32, device="neuron")
    return torch.histc(ids, bins=4, min=0, max=3)


# ------------------------------------------------------------------ CPU fallback


def test_an_op_neuron_runs_on_the_cpu_is_a_counted_round_trip_not_an_eager_compile(sim: Any) -> None:
    assert "aten::histc" in cpu_fallback.ops()  # the default table
    torch_neuronx.clear_op_tracking()
    counts = _int_histc()
    expected = torch.histc(torch.tensor(EXPERT_IDS, dtype=torch.float32), bins=4, min=0, max=3)
    # CUDA's contract for integer input, which the CPU kernel lacks: same counts, the input's dtype.
    assert counts.device.type == "neuron" and counts.dtype == torch.int32
    assert torch.equal(counts.cpu(), expected.to(torch.int32))
    st = sim.stats()
    assert st["cpu_fallbacks"] == 1
    assert st["cpu_fallback_ops"] == {"aten::histc": 1}
    assert st["cpu_fallback_d2h_bytes"] == len(EXPERT_IDS) * 4  # the ids out to the host
    assert st["cpu_fallback_h2d_bytes"] == 4 * 4  # the four counts back
    assert not [s for s in st["eager_signature_list"] if "histc" in s]  # nothing compiled for it
    _int_histc()
    assert torch_neuronx.get_fallback_ops() == ["aten::histc", "aten::histc"]  # one entry per call
    assert backend_metrics.fallback_ops() == {"aten::histc": 2}
    torch_neuronx.clear_op_tracking()
    assert torch_neuronx.get_fallback_ops() == [] and backend_metrics.fallback_ops() == {}
    assert sim.stats()["cpu_fallbacks"] == 2  # the byte and call counters are stats(), not op tracking


def test_the_fallback_table_decides_what_is_a_round_trip(sim: Any, fallback_ops: Any) -> None:
    fallback_ops(["cumsum"])
    x = torch.arange(6, dtype=torch.float32, device="neuron")
    assert torch.equal(torch.cumsum(x, 0).cpu(), torch.cumsum(torch.arange(6.0), 0))
    counts = _int_histc()  # histc no longer falls back: a device kernel, compiled like any eager op
    st = sim.stats()
    assert st["cpu_fallback_ops"] == {"aten::cumsum": 1}
    assert [s for s in st["eager_signature_list"] if s.startswith("aten::histc(")] == ["aten::histc(i32[12])"]
    assert counts.dtype == torch.int32 and counts.tolist() == [2, 4, 2, 4]
    with pytest.raises(ValueError, match=r"'aten::no_such_op' is not an ATen operator"):
        fallback_ops(["aten::no_such_op"])
    with pytest.raises(ValueError, match=r"'histc.out'.*without overload"):
        cpu_fallback.parse("histc.out")
    assert cpu_fallback.parse("none") == () and cpu_fallback.parse(" histc, aten::histc ") == ("aten::histc",)


def test_moe_experts_through_grouped_mm_run_on_neuron_with_histc_as_their_round_trip(sim: Any) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        reference = model(ids).logits
    # Transformers >= 5 routes experts through integrations/moe.py; its grouped_mm path counts tokens per
    # expert with torch.histc on int32 ids off the CPU. Older releases loop over experts in Python.
    grouped = hasattr(model, "set_experts_implementation")
    if grouped:
        model.set_experts_implementation("grouped_mm")
    model.to("neuron")
    # Eagerly, op by op: a bucketed inference call would compile the forward, and fallbacks inside a compiled
    # graph are not modelled.
    accelerate_neuron.disable_bucketing(model)
    sim.reset_stats()
    with torch.no_grad():
        out = model(ids.to("neuron")).logits.cpu()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    fallbacks = sim.stats()["cpu_fallback_ops"]
    assert fallbacks == ({"aten::histc": config.num_hidden_layers} if grouped else {})


def test_bad_simulator_settings_name_the_value_and_what_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_fallback.ENV, "histc,cuda_only_thing")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_SIM_CPU_FALLBACK_OPS: 'cuda_only_thing'"):
        cpu_fallback.from_env()
    monkeypatch.setenv(device_module.MEM_GET_INFO_ENV, "maybe")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_SIM_MEM_GET_INFO='maybe': expected 1"):
        device_module.mem_get_info_from_env()


# ------------------------------------------------------------------ compile metrics and cache counters


def test_dynamo_metrics_list_each_graph_the_backend_compiled(sim: Any) -> None:
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    assert torch.neuron.get_dynamo_metrics() == []
    assert backend_metrics.compile_metrics() == ((), "torch.neuron.get_dynamo_metrics()")
    layer = torch.nn.Linear(4, 4).to("neuron")
    step = torch.compile(lambda x: layer(x).relu().sum(), backend="neuron", dynamic=False)
    step(torch.ones(2, 4, device="neuron")).backward()
    step(torch.ones(3, 4, device="neuron"))  # a new shape: another forward graph
    records = torch.neuron.get_dynamo_metrics()
    st = sim.stats()
    assert len(records) == len(st["graphs"]) == 3  # forward + backward, then the second forward
    assert [r.graph_id for r in records] == [g["cache_key"] for g in st["graphs"]]
    assert [r.graph_node_count for r in records] == [g["num_nodes"] for g in st["graphs"]]
    assert not any(r.has_collectives for r in records)
    assert [type(r).__name__ for r in torch_neuronx.get_dynamo_metrics()] == ["NeuronCompilationMetrics"] * 3
    graphs, source = backend_metrics.compile_metrics()
    assert [g.nodes for g in graphs] == [r.graph_node_count for r in records] and source.startswith("torch.neuron")
    assert all(g.compile_seconds == 0 for g in graphs)  # the simulator compiles nothing: no timings
    torch.neuron.reset_dynamo_metrics()
    assert torch.neuron.get_dynamo_metrics() == [] and len(sim.stats()["graphs"]) == 3  # stats() keep them


def test_cache_counters_follow_the_neff_cache(sim: Any) -> None:
    torch._dynamo.reset()
    assert torch_neuronx.metrics.get_counter_value("CompilationCache.TotalCompilations") is None
    assert backend_metrics.cache_counters() is None  # nothing counted yet: "not available", not "0 hits"
    fn = torch.compile(lambda x: x * 2 + 1, backend="neuron", dynamic=False)
    fn(torch.ones(5, device="neuron"))
    torch._dynamo.reset()  # the same graph again in this process: found compiled, in memory
    fn(torch.ones(5, device="neuron"))
    st = sim.stats()
    counters = backend_metrics.cache_counters()
    assert counters == {
        "compilations": st["compiles"] + st["eager_compiles"],
        "persistent_hits": st["eager_cache_hits"],
        "persistent_misses": st["compiles"] + st["eager_compiles"],
        "in_memory_hits": 1,
    }
    assert (st["compiles"], st["compile_cache_hits"]) == (1, 1)


CACHE_RUN = """
import torch, json
from accelerate_neuron import backend_metrics
fn = torch.compile(lambda x: (x * 3).sum(), backend="neuron", dynamic=False)
fn(torch.ones(7, device="neuron"))
print(json.dumps(backend_metrics.cache_counters()))
"""


@pytest.mark.one_pair
def test_a_warm_neff_cache_shows_as_persistent_hits_in_a_new_process() -> None:
    shared = clean_env()["TORCH_NEURONX_NEFF_CACHE_DIR"]  # one empty cache folder for both runs
    runs = [
        last_json(run_python(CACHE_RUN, ACCELERATE_NEURON_SIMULATE="1", TORCH_NEURONX_NEFF_CACHE_DIR=shared).stdout)
        for _ in range(2)
    ]
    cold, warm = runs
    assert cold["compilations"] >= 2 and cold["persistent_hits"] == 0  # the graph and its eager ops
    assert warm["compilations"] == 0 and warm["persistent_hits"] == cold["compilations"]


# ------------------------------------------------------------------ the reader degrades


def test_the_reader_degrades_to_none_where_the_backend_offers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    bare = types.ModuleType("torch_neuronx")
    monkeypatch.setitem(sys.modules, "torch_neuronx", bare)
    monkeypatch.delitem(sys.modules, "torch_neuronx.metrics")
    monkeypatch.delattr(device_module, "get_dynamo_metrics")
    snap = backend_metrics.snapshot()
    assert (snap.graphs, snap.cache, snap.fallbacks, snap.sources) == (None, None, None, {})
    assert backend_metrics.since(snap, backend_metrics.Snapshot()).as_dict()["graphs_compiled"] is None

    def broken(*args: Any) -> Any:
        raise RuntimeError("runtime not ready")

    bare.get_dynamo_metrics = bare.get_fallback_ops = broken
    bare.metrics = types.SimpleNamespace(get_counter_value=broken)
    snap = backend_metrics.snapshot()
    assert (snap.graphs, snap.cache, snap.fallbacks) == (None, None, None)


def test_the_reader_takes_torch_neuronx_names_when_torch_neuron_lacks_them(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(device_module, "get_dynamo_metrics")
    torch.compile(lambda x: x - 1, backend="neuron", dynamic=False)(torch.ones(3, device="neuron"))
    graphs, source = backend_metrics.compile_metrics()
    assert len(graphs) == sim.stats()["compiles"] == 1 and source == "torch_neuronx.get_dynamo_metrics()"


# ------------------------------------------------------------------ the dry-run report


FALLBACK_SCRIPT = f"""
import torch
ids = torch.tensor({EXPERT_IDS!r}, dtype=torch.int32, device="neuron")
for _ in range(3):
    counts = torch.histc(ids, bins=4, min=0, max=3)
fn = torch.compile(lambda x: x.float() * 2, backend="neuron", dynamic=False)
fn(counts)
"""


def _simulate(*args: str) -> str:
    command = [sys.executable, "-m", "accelerate_neuron", "simulate", "--cores", "1", *args]
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.one_pair
def test_the_dry_run_report_names_the_ops_that_ran_on_the_cpu(tmp_path: Path) -> None:
    script = tmp_path / "fallbacks.py"
    script.write_text(textwrap.dedent(FALLBACK_SCRIPT))
    report = json.loads(_simulate("--json", "--", "python", str(script)))
    fb = report["cpu_fallbacks"]
    assert fb["calls"] == 3 and fb["ops"] == [{"op": "aten::histc", "calls": 3, "processes": 1}]
    assert (fb["d2h_bytes"], fb["h2d_bytes"]) == (3 * len(EXPERT_IDS) * 4, 3 * 4 * 4)
    assert fb["source"] == "torch_neuronx.get_fallback_ops()"
    assert report["backend"]["graphs_compiled"] == report["compiles"] + report["compile_cache_hits"] == 1
    assert report["backend"]["cache"]["compilations"] == report["compiles"] + report["eager"]["compiles"]
    text = _simulate("--", "python", str(script))
    assert "CPU fallbacks: 3 calls of ops Neuron runs on the CPU" in text
    assert "  aten::histc x3" in text
    assert "the backend's own metrics: 1 graph (torch.neuron.get_dynamo_metrics())" in text
