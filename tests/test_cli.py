"""The ``accelerate-neuron`` command, run as a user runs it (the console script, in a fresh process).

Flag validation and the report logic are also checked in-process, where they are cheap.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from accelerate_neuron.cli import build_parser, main
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
        (["bogus"], "invalid choice: 'bogus' (choose from 'demo', 'env', 'simulate', 'precompile', 'cache')"),
    ],
)
def test_bad_flags_name_the_flag_and_what_is_allowed(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_multi_word_flag_also_takes_underscores(capsys: pytest.CaptureFixture[str]) -> None:
    """As accelerate's and torchrun's: `--max_new_tokens` is `--max-new-tokens`; help shows the dashed spelling."""
    checked = set()
    for name, sub in _subcommands().items():
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and "-" in option[2:] and action.help != argparse.SUPPRESS:
                    alias = "--" + option[2:].replace("-", "_")
                    assert sub._option_string_actions[alias].dest == action.dest, (name, alias)
                    listed = [line for line in sub.format_help().splitlines() if line.strip().startswith("-")]
                    assert alias not in sub.format_usage() and not any(alias in line for line in listed), alias
                    checked.add(f"{name} {option}")
    assert {"demo --max-new-tokens", "demo --device-map", "env --no-init", "env --config-file"} <= checked
    assert {"simulate --compile-seconds", "precompile --eager-seconds"} <= checked

    parsed = build_parser().parse_args(["simulate", "--compile_seconds", "5", "--eager_seconds=1", "--", "python"])
    assert (parsed.compile_seconds, parsed.eager_seconds, parsed.command) == (5.0, 1.0, ["--", "python"])
    parsed = build_parser().parse_args(["demo", "--max", "3", "--device_map", "balanced"])  # an abbreviation too
    assert (parsed.max_new_tokens, parsed.device_map) == (3, "balanced")
    with pytest.raises(SystemExit):
        main(["demo", "--max_new_tokens", "0"])
    assert "argument --max_new_tokens: 0 is not allowed; expected a positive integer" in capsys.readouterr().err
    # A flag of the user's command after `--` is the command's, whatever its spelling.
    parsed = build_parser().parse_args(["simulate", "--", "python", "train.py", "--compile_seconds", "9"])
    assert parsed.compile_seconds == 60 and parsed.command[-2:] == ["--compile_seconds", "9"]


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
    import accelerate_neuron
    from accelerate_neuron import simulator

    path = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    for prompt in ["hello", "the neuron core runs"]:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
    print(json.dumps({"compiles": simulator.stats()["compiles"], "padding": accelerate_neuron.padding_stats()}))
"""


@pytest.mark.one_pair
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
    # The padding the process counted is what the report prints: two one-row prompts padded to 16 columns.
    counted = last_json(proc.stderr)["padding"]
    for family in ("generate_prefill", "generate_decode"):
        entry = report["padding"][family]
        assert (entry["computed"], entry["real"]) == (counted[family]["computed"], counted[family]["real"])
        assert entry["ratio"] == round(entry["computed"] / entry["real"], 3)
    # 4.x prefills all but the last prompt token (15 of the bucket's 16 columns), as in tests/test_padding.py.
    assert report["padding"]["generate_prefill"]["computed"] in (2 * 16, 2 * 15)
    assert report["padding"]["generate_decode"]["ratio"] == 1.0


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


@pytest.mark.slow
@pytest.mark.one_pair
def test_simulate_reports_every_process_the_job_starts() -> None:
    """Children of multiprocessing's spawn (stopped with terminate(): SIGTERM) and forkserver (which leave through
    os._exit), and of subprocess, write their own record; a forked child, which shares its parent's counters, does
    not report them again."""
    script = REPO / "tests" / "scripts" / "children.py"
    proc = cli("simulate", "--cores", "1", "--json", "--", "python", str(script), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-8000:]
    report = json.loads(proc.stdout)
    said = {}
    for line in proc.stderr.splitlines():
        if line.startswith('{"pid"'):
            fields = json.loads(line)
            said[fields.pop("kind")] = fields
    assert said["terminated"]["exitcode"] == -15  # SIGTERM's default action, after the record was written
    by_pid = {p["pid"]: p for p in report["processes"]}
    kinds = ("parent", "spawn", "forkserver", "subprocess")
    assert sorted(by_pid) == sorted(said[k]["pid"] for k in kinds), (by_pid.keys(), said)
    assert report["processes_started"] == 4  # not the fork child
    for kind in kinds:
        assert by_pid[said[kind]["pid"]]["eager_signatures"] == said[kind]["eager"], kind
    spawn = by_pid[said["spawn"]["pid"]]
    assert spawn["compiles"] + spawn["compile_cache_hits"] == said["spawn"]["compiles"] == 1
    assert report["distinct_graphs"] == 1 and report["graphs"][0]["processes"] == 1


# ------------------------------------------------------------------ signals end the whole tree

RANK_SLEEPS = """
import os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rank = os.environ.get('RANK', '0')
(out / f".rank{rank}.tmp").write_text(str(os.getpid()))
(out / f".rank{rank}.tmp").replace(out / f"rank{rank}.pid")  # whole: the test reads it as soon as it exists
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "signal_name", "to_group"),
    [("simulate", "SIGTERM", False), ("simulate", "SIGINT", True), ("precompile", "SIGTERM", False)],
)
def test_a_signal_ends_every_rank_the_command_started(
    tmp_path: Path, command: str, signal_name: str, to_group: bool
) -> None:
    """SIGTERM to the command (a scheduler, `timeout`), or Ctrl-C (SIGINT to the terminal's whole group): torchrun
    and both of its ranks end too, and the command exits 128 + 15 on SIGTERM."""
    import os
    import signal
    import time

    import psutil

    script, out = tmp_path / "sleep.py", tmp_path / "out"
    script.write_text(RANK_SLEEPS)
    options = ["--cores", "2"] + (["--jobs", "1"] if command == "precompile" else [])
    launcher = ["torchrun", "--standalone", "--nproc-per-node", "2", str(script), str(out)]
    cli_command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "accelerate_neuron"]
    log = tmp_path / "log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [*cli_command, command, *options, "--", *launcher],
            env=clean_env(OMP_NUM_THREADS="1"),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: SIGINT to the group is a terminal's Ctrl-C
        )
        try:
            deadline = time.monotonic() + 300
            while len(list(out.glob("rank*.pid"))) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            ranks = [int(p.read_text()) for p in out.glob("rank*.pid")]
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            assert set(ranks) < set(tree)  # the ranks, torchrun and the worker (precompile) are the command's
            signum = getattr(signal, signal_name)
            if to_group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)  # an orphan's last breath: reaped by init
    assert not [pid for pid in tree if _alive(pid)], f"left behind: {tree}\n{log.read_text()[-4000:]}"
    if signal_name == "SIGTERM":
        assert code == 128 + signal.SIGTERM and "terminated (signal 15)" in log.read_text(), log.read_text()[-4000:]
    else:
        assert code != 0, log.read_text()[-4000:]


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


def _hub_cache(root: Path, repo_id: str) -> Path:
    """A Hugging Face Hub cache holding ``repo_id`` (a tiny Qwen3), laid out as huggingface_hub writes it."""
    from accelerate_neuron import tiny

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    tiny.save_pretrained(repo / "snapshots" / commit, "qwen3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_demo_takes_a_hub_model_id(tmp_path: Path) -> None:
    """A Hub id is fetched with huggingface_hub (from its cache when offline); offline and not cached: a clear error."""
    snapshot = _hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3")
    proc = cli(
        "demo", "--model", "tiny-org/tiny-qwen3", "--max_new_tokens", "4", "--json", HF_HUB_CACHE=str(tmp_path / "hub")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fetching tiny-org/tiny-qwen3 from the local Hugging Face cache (HF_HUB_OFFLINE is set)" in proc.stderr
    result = last_json(proc.stdout)
    assert result["model_path"] == str(snapshot) and result["new_tokens"] == 4
    assert set(result["placement"]["bytes"]) == {"neuron:0"}

    missing = cli("demo", "--model", "tiny-org/not-here", HF_HUB_CACHE=str(tmp_path / "hub"))
    assert missing.returncode == 1
    assert (
        "accelerate-neuron: error: 'tiny-org/not-here' is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
        "set: run once where the Hub is reachable, or pass a local folder written by save_pretrained()"
    ) in missing.stderr
    assert "starting a simulated Neuron device" not in missing.stderr  # it failed before doing anything else


def test_precompile_progress_bar_is_huggingface_hubs_and_honours_its_switch() -> None:
    import io

    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, tqdm

    from accelerate_neuron.cli import precompile

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = precompile._bar(Terminal())
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    assert precompile._bar(io.StringIO()) is None  # not a terminal: progress lines instead
    disable_progress_bars()  # what HF_HUB_DISABLE_PROGRESS_BARS=1 sets
    try:
        assert precompile._bar(Terminal()) is None
    finally:
        enable_progress_bars()


@pytest.mark.one_pair
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
