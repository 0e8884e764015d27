"""The ``accelerate-neuron`` command, run as a user runs it (the console script, in a fresh process).

Flag validation and the report logic are also checked in-process, where they are cheap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from accelerate_neuron.cli import main
from accelerate_neuron.cli._dryrun import build_report, recompile_causes
from accelerate_neuron.simulator.report import compress_entries, summarize_module
from helpers import REPO, clean_env, last_json

SCRIPT = Path(sys.executable).with_name("accelerate-neuron")
GIB = 2**30
_COSTS = {"seconds_per_graph": 60, "seconds_per_signature": 2}


def cli(*args: str, cwd: Path = REPO, **env: str | None) -> subprocess.CompletedProcess:
    """Run the installed console script with a clean environment (no simulator unless asked)."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "accelerate_neuron"]
    return subprocess.run(
        [*command, *args], env=clean_env(**env), capture_output=True, text=True, timeout=900, cwd=str(cwd)
    )


# ------------------------------------------------------------------ help and bad flags


def test_help_names_every_command_and_bad_flag_exits_2() -> None:
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "env", "simulate"):
        assert command in proc.stdout
    bad = cli("simulate", "--cores", "0", "--", "python", "-c", "pass")
    assert bad.returncode == 2
    assert "argument --cores: 0 is not allowed; expected a positive integer" in bad.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--cores", "two", "--", "python"], "argument --cores: 'two' is not a whole number"),
        (["simulate", "--cores", "999", "--", "python"], "argument --cores: 999 is too many"),
        (["simulate", "--hbm", "24XB", "--", "python"], "argument --hbm: invalid size '24XB'"),
        (["simulate", "--hbm", "0GiB", "--", "python"], "argument --hbm: '0GiB' is not allowed"),
        (["simulate", "--compile-seconds", "-1", "--", "python"], "argument --compile-seconds: '-1' is not allowed"),
        (["simulate", "--eager-seconds", "nan", "--", "python"], "argument --eager-seconds: 'nan' is not allowed"),
        (["simulate", "--json"], "missing the command to run after '--'"),
        (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not allowed"),
        (["demo", "--device-map", "spread"], "argument --device-map: invalid choice: 'spread' (choose from 'auto', "),
        (["demo", "--model", "/no/such/folder"], "argument --model: '/no/such/folder' is not a folder"),
        (["env", "--bogus"], "accelerate-neuron env: error: unrecognized arguments: --bogus"),
        (["bogus"], "invalid choice: 'bogus' (choose from 'demo', 'env', 'simulate', 'precompile')"),
    ],
)
def test_bad_flags_name_the_flag_and_what_is_allowed(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_model_must_be_a_saved_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--model", str(tmp_path)])
    assert "has no config.json; expected a folder written by save_pretrained()" in capsys.readouterr().err


# ------------------------------------------------------------------ env


def _placeholder_torch_neuronx(root: Path) -> Path:
    """What `pip install torch-neuronx` from PyPI installs: a package that refuses to import."""
    package = root / "site" / "torch_neuronx"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("WRONG PACKAGE: see the AWS Neuron documentation")\n')
    return package.parent


def _accelerate_config(root: Path) -> Path:
    folder = root / "hf" / "accelerate"
    folder.mkdir(parents=True)
    (folder / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 4\n"
    )
    return folder.parent


def _transformers_reads_async_load_switch() -> bool:
    root = Path(transformers.__file__).parent
    return any(
        "HF_DEACTIVATE_ASYNC_LOAD" in (root / name).read_text()
        for name in ("core_model_loading.py", "modeling_utils.py")
        if (root / name).exists()
    )


def test_env_json_on_simulated_trn2_reports_versions_cores_and_misconfigurations(tmp_path: Path) -> None:
    proc = cli(
        "env",
        "--json",
        ACCELERATE_NEURON_SIMULATE="2",
        ACCELERATE_NEURON_SIM_HBM="16GiB",
        NEURON_RT_VISIBLE_CORES="0-1",
        PYTHONPATH=str(_placeholder_torch_neuronx(tmp_path)),
        HF_HOME=str(_accelerate_config(tmp_path)),
        HF_DEACTIVATE_ASYNC_LOAD=None,
        ACCELERATE_MIXED_PRECISION=None,
    )
    assert proc.returncode == 1, proc.stderr  # error-level problems found
    facts = json.loads(proc.stdout)
    versions = facts["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__
    assert versions["torch-neuronx"].startswith("simulated (the installed torch-neuronx")
    assert facts["device"]["kind"] == "simulated"
    assert facts["device"]["visible_cores"] == 2
    assert [c["total"] for c in facts["device"]["cores"]] == [16 * GIB, 16 * GIB]
    assert facts["settings"]["NEURON_RT_VISIBLE_CORES"] == "0-1"
    # env imports what the patches wait for: every patch is decided, none pending.
    statuses = {p["status"] for p in facts["status"]["patches"]}
    assert statuses and statuses <= {"applied", "skipped", "absent"}, statuses
    assert {p["name"] for p in facts["status"]["plugins"]} >= {"placement", "generation", "training", "launch"}

    problems = {p["problem"]: p for p in facts["problems"]}
    text = "\n".join(problems)
    placeholder = next(p for p in facts["problems"] if "placeholder" in p["problem"])
    assert placeholder["severity"] == "error"
    assert "pip uninstall -y torch-neuronx" in placeholder["fix"]
    assert "starts 4 processes but only 2 Neuron core(s) are visible" in text
    assert "NEURON_RT_VISIBLE_CORES=0-1 is exported while" in text
    assert "fp16 requested (mixed_precision: fp16" in text
    assert ("HF_DEACTIVATE_ASYNC_LOAD is unset" in text) == _transformers_reads_async_load_switch()
    assert all(p["fix"] for p in facts["problems"])


def test_env_text_without_neuron_is_inert_and_finds_nothing(tmp_path: Path) -> None:
    proc = cli("env", HF_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "none: accelerate-neuron is inert here" in proc.stdout
    assert "torch-neuronx      not installed" in proc.stdout
    assert f"torch              {torch.__version__}" in proc.stdout
    assert "No misconfiguration found." in proc.stdout


# ------------------------------------------------------------------ simulate

DRY_RUN_SCRIPT = """
    import json, sys
    import torch
    from accelerate_neuron import simulator, tiny

    def main():
        model = tiny.model("qwen3").to("neuron:1")  # freed when main() returns: still reported
        step = torch.compile(lambda x: x * 2 + 1, backend="neuron", dynamic=False)
        for n in (2, 3, 5):
            step(torch.ones(n, device="neuron:1")).cpu()
        weights = {id(p): p.numel() * p.element_size() for p in model.parameters()}
        weights.update({id(b): b.numel() * b.element_size() for b in model.buffers()})
        st = simulator.stats()
        print(json.dumps({"weights": sum(weights.values()), "compiles": st["compiles"],
                          "eager_signatures": st["eager_signatures"], "h2d": st["h2d_bytes"]}))

    main()
    sys.exit(3)
"""


def test_simulate_json_reports_placement_memory_compiles_and_recompile_causes(tmp_path: Path) -> None:
    script = tmp_path / "dry_run.py"
    script.write_text(textwrap.dedent(DRY_RUN_SCRIPT))
    proc = cli(
        "simulate",
        "--cores",
        "2",
        "--hbm",
        "8GiB",
        "--compile-seconds",
        "10",
        "--eager-seconds",
        "0.5",
        "--json",
        "--",
        "python",
        str(script),
    )
    assert proc.returncode == 3, proc.stderr  # the command's exit code
    report = json.loads(proc.stdout)  # stdout is the report only: the script's output went to stderr
    truth = last_json(proc.stderr)
    assert report["exit_code"] == 3
    assert (report["simulated_cores"], report["hbm_per_core"]) == (2, 8 * GIB)
    assert report["processes_using_device"] == 1

    model = report["placement"][0]
    assert model["model"] == "Qwen3ForCausalLM"
    assert model["alive_at_exit"] is False
    assert model["bytes"] == {"core 1": truth["weights"]}
    assert report["memory"]["peak_per_core"]["1"] >= truth["weights"]
    assert "0" not in report["memory"]["peak_per_core"]
    assert report["h2d_bytes"] == truth["h2d"] >= truth["weights"]

    assert report["compiles"] == truth["compiles"] == 3
    assert [g["inputs"][0]["shape"] for g in report["graphs"]] == ["f32[2]", "f32[3]", "f32[5]"]
    cause = report["recompile_causes"][0]
    assert (cause["kind"], cause["recompiles"]) == ("shape", 2)
    assert cause["values"] == {"L['x']": ["f32[2]", "f32[3]", "f32[5]"]}
    assert report["eager"]["distinct_signatures"] >= truth["eager_signatures"]
    est = report["estimate"]
    assert est["seconds"] == 3 * 10 + 0.5 * est["eager_signatures"]


GENERATE_SCRIPT = """
    import json, sys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from accelerate_neuron import simulator

    path = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    for prompt in ["hello", "the neuron core runs"]:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
    print(json.dumps({"compiles": simulator.stats()["compiles"]}))
"""


def test_simulate_does_not_change_what_the_script_compiles(tmp_path: Path) -> None:
    # The dry run's model tracking hooks run inside traced code; they must not break graphs.
    from accelerate_neuron import tiny

    model_dir = tiny.save_pretrained(tmp_path / "tiny-qwen3", "qwen3")
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(GENERATE_SCRIPT))
    alone = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        env=clean_env(ACCELERATE_NEURON_SIMULATE="4"),
        capture_output=True,
        text=True,
    )
    assert alone.returncode == 0, alone.stderr
    proc = cli("simulate", "--json", "--", "python", str(script), str(model_dir))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # One prefill graph (prompt bucket) and one decode graph, alone and under the dry run alike.
    assert report["compiles"] == last_json(proc.stderr)["compiles"] == last_json(alone.stdout)["compiles"] == 2
    assert not report.get("graph_breaks")


DDP_SCRIPT = """
    import torch, torch.distributed as dist
    dist.init_process_group(backend="neuron")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to("neuron")
    t = torch.ones(8, device="neuron")
    dist.all_reduce(t)
    assert t.sum().item() == 16.0
    dist.destroy_process_group()
"""


def test_simulate_reaches_every_torchrun_worker_one_core_each(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    proc = cli("simulate", "--cores", "2", "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 used the device" in out
    memory = out.split("Memory per core")[1].split("Compiled graphs")[0]
    assert "core 0" in memory and "rank 0" in memory
    assert "core 1" in memory and "rank 1" in memory
    assert "is used by 2 processes" not in out
    assert out.count("Sequential (rank") == 2


# ------------------------------------------------------------------ report logic (in-process)


def _graph(compile_id: str, dynamo_graph: int, **inputs: list[int]) -> dict:
    described = [{"name": n, "shape": s, "dtype": "int64"} for n, s in inputs.items()]
    return {"kind": "inference", "compile_id": compile_id, "dynamo_graph": dynamo_graph, "dynamo_inputs": described}


def test_recompile_causes_name_the_changing_input_and_other_guards() -> None:
    graphs = [
        _graph("0/0", 0, input_ids=[1, 7], mask=[1, 7]),
        _graph("0/1", 1, input_ids=[1, 8], mask=[1, 7]),
        _graph("0/2", 2, input_ids=[1, 9], mask=[1, 7]),
        _graph("1/0", 3, x=[4]),
        _graph("1/1", 4, x=[4]),  # same inputs: a guard on something else failed
        _graph("2/0", 5, **{"layers[0].keys": [2, 8]}),
        _graph("2/1", 6, **{"layers[1].keys": [2, 8]}),  # the same code entered for another layer
    ]
    causes = {c["frame"]: c for c in recompile_causes(graphs)}
    assert (causes["0"]["kind"], causes["0"]["recompiles"]) == ("shape", 2)
    assert causes["0"]["values"] == {"input_ids": ["i64[1,7]", "i64[1,8]", "i64[1,9]"]}  # mask never changed
    assert (causes["1"]["kind"], causes["1"]["values"]) == ("guard", {})
    assert causes["2"]["kind"] == "object"
    assert causes["2"]["values"] == {"layers[1].keys": ["absent", "i64[2,8]"], "layers[0].keys": ["i64[2,8]", "absent"]}
    assert next(iter(recompile_causes(graphs)))["frame"] == "0"  # most recompiles first


def test_recompile_causes_tell_generates_prefill_then_decode_from_a_new_shape() -> None:
    prefill_then_decode = [
        _graph("0/0", 0, **{"L['kwargs']['input_ids']": [2, 32], "L['kwargs']['mask']": [2, 1, 32, 64]}),
        _graph("0/1", 1, **{"L['kwargs']['input_ids']": [2, 1], "L['kwargs']['mask']": [2, 1, 1, 64]}),
        _graph("0/2", 2, **{"L['kwargs']['input_ids']": [2, 64], "L['kwargs']['mask']": [2, 1, 64, 128]}),
    ]
    causes = recompile_causes(prefill_then_decode)
    assert sorted((c["kind"], c["recompiles"]) for c in causes) == [("decode", 1), ("shape", 1)]
    # A new prompt length is never the prefill/decode pair, even when it follows a decode step.
    growing = [_graph(f"0/{n}", n, input_ids=[1, 7 + n]) for n in range(3)]
    assert [(c["kind"], c["recompiles"]) for c in recompile_causes(growing)] == [("shape", 2)]


def test_graph_breaks_and_frame_functions_reach_the_report(sim: object) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y + 1

    torch.compile(step, backend="neuron")(torch.ones(3, device="neuron"))
    record = {"pid": 1, "stats": {**sim.stats(), "initialized": True}, "models": []}
    report = build_report([record], command=["x"], exit_code=0, cores=2, hbm=GIB, **_COSTS)
    assert report["compiles"] == 2  # the break splits step() into two graphs
    first, resumed = sorted(g["function"].split(" ")[0] for g in report["graphs"])
    assert (first, resumed.rsplit("_", 1)[0]) == ("step", "torch_dynamo_resume_in_step_at")
    (graph_break,) = report["graph_breaks"]
    assert graph_break["function"].startswith("step (tests/test_cli.py:")
    assert graph_break["where"].startswith("tests/test_cli.py:")


def _record(rank: int, visible: list[int], peak_by_index: dict[str, int]) -> dict:
    return {
        "pid": 100 + rank,
        "rank": str(rank),
        "stats": {
            "initialized": True,
            "visible_cores": visible,
            "max_memory_allocated": peak_by_index,
            "memory_allocated": dict.fromkeys(peak_by_index, 0),
            "compiles": 0,
            "graphs": [],
        },
        "models": [],
    }


def test_report_maps_visible_indices_to_physical_cores_and_flags_sharing() -> None:
    common = {"command": ["x"], "exit_code": 0, "cores": 4, **_COSTS}
    separate = build_report([_record(0, [2], {"0": 10}), _record(1, [3], {"0": 20})], hbm=100, **common)
    assert separate["memory"]["peak_per_core"] == {"2": 10, "3": 20}
    assert separate["memory"]["shared_cores"] == []
    shared = build_report([_record(0, [0, 1], {"0": 60}), _record(1, [0, 1], {"0": 70})], hbm=100, **common)
    assert shared["memory"]["shared_cores"] == [0]
    assert shared["memory"]["over_budget_cores"] == [0]  # 60 + 70 bytes on a 100-byte core


def test_placement_summary_follows_the_weights(sim: object) -> None:
    from accelerate_neuron import tiny

    model = tiny.model("llama")
    model.model.layers[1].to("neuron:1")
    model.lm_head.to("neuron:1")
    summary = summarize_module(model)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    assert summary["bytes"]["neuron:1"] == layer_bytes + head_bytes
    assert ["model.layers.1", "neuron:1"] in summary["placement"]
    assert ["lm_head", "neuron:1"] in summary["placement"]
    assert ["model.layers.0", "cpu"] in summary["placement"]
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())


def test_compress_entries_merges_consecutive_layers_on_one_device() -> None:
    a, b = "neuron:0", "neuron:1"
    entries = [["m.layers.0", a], ["m.layers.1", a], ["m.layers.2", b], ["m.norm", b], ["m.head.3", b]]
    assert compress_entries(entries) == [["m.layers.0-1", a], ["m.layers.2", b], ["m.norm", b], ["m.head.3", b]]


# ------------------------------------------------------------------ demo


def test_demo_json_places_the_model_on_neuron_and_generates_the_corpus() -> None:
    proc = cli("demo", "--json", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = last_json(proc.stdout)
    assert result["device"] == "simulated"
    assert "no Trainium here: starting a simulated Neuron device" in proc.stderr
    assert result["cores"] == 1
    # The toy model was trained on tiny.CORPUS: greedy decoding recites it.
    assert result["text"].startswith("the neuron core runs the compiled graph")
    assert result["new_tokens"] == 8
    # device_map="auto" put every weight on the Neuron core.
    assert set(result["placement"]["bytes"]) == {"neuron:0"}
    assert result["model_device"] == "neuron:0"
    assert result["output_device"] == "neuron:0"  # generate() answers on the device of the caller's inputs
    # Static cache + compiled decode step: the first call compiles, the second reuses the graphs.
    # (Eager signatures may still grow once: 4.57 resets the static cache with two new eager ops.)
    assert result["first_generate"]["compiles"] >= 1
    assert result["second_generate"]["compiles"] == 0
    assert result["second_generate"]["eager_signatures"] < result["first_generate"]["eager_signatures"]
    assert result["load"]["h2d_bytes"] >= sum(result["placement"]["bytes"].values())
    assert result["tokens_per_second"] > 0
    # What the backend's own functions report agrees with the simulator's counters, call by call.
    for call in ("first_generate", "second_generate"):
        counts, backend = result[call], result[call]["backend"]
        assert backend["graphs_compiled"] == counts["compiles"] + counts["compile_cache_hits"]
        assert backend["cpu_fallbacks"] == {}
        if backend["cache"] is not None:  # None when nothing was counted (the second call compiles nothing)
            assert backend["cache"]["compilations"] == counts["compiles"] + counts["eager_compiles"]
    assert result["first_generate"]["backend"]["cache"]["compilations"] >= 1
    assert set(result["first_generate"]["backend"]["sources"]) == {"graphs", "cache", "cpu_fallbacks"}


def test_demo_on_a_whole_chip_keeps_a_small_model_on_one_core_unless_asked_to_spread() -> None:
    auto = cli("demo", "--cores", "4", "--max-new-tokens", "4")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert 'from_pretrained(device_map="auto") put the weights on:' in auto.stdout
    assert "the whole model is on neuron:0" in auto.stdout
    assert "--device-map balanced" not in auto.stdout  # the hint is for a one-core run
    spread = cli("demo", "--json", "--cores", "4", "--device-map", "balanced", "--max-new-tokens", "4")
    assert spread.returncode == 0, spread.stdout + spread.stderr
    result = last_json(spread.stdout)
    assert result["device_map"] == "balanced"
    assert len(result["placement"]["bytes"]) >= 2 and all(d.startswith("neuron:") for d in result["placement"]["bytes"])
    assert result["text"].startswith("the neuron core runs")
