"""``accelerate config`` / ``accelerate launch`` / ``torchrun`` on the simulated Neuron device.

In-process tests drive the CLI functions the commands call (config default,
the questionnaire, launch argument handling). The ``slow`` tests run the
commands as a user would, as subprocesses, each rank reporting its distributed
type, device index, physical core (``simulator.stats()["visible_cores"]``)
and numbers that must match a single-process run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from accelerate_neuron import patching, tiny
from accelerate_neuron.builtin.enum_backfill import has_native_member
from accelerate_neuron.builtin.launch.cores import core_for_rank
from helpers import run_launcher

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(SCRIPTS))

import accelerate_train  # noqa: E402
import tp_step  # noqa: E402


def _record(key: str) -> patching.PatchRecord | None:
    return {r.key: r for r in patching.records()}.get(key)


def _reports(out_dir: Path, count: int) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == count, f"expected {count} rank reports, found {[f.name for f in files]}"
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


def _assert_own_cores(reports: list[dict]) -> None:
    for report in reports:
        assert report["device"] == "neuron:0", report  # each process sees exactly its own core
        assert report["visible_cores"] == [report["physical_core"]], report
    assert [r["physical_core"] for r in reports] == list(range(len(reports)))


# ------------------------------------------------------------------ in-process


def test_rank_gets_its_own_core_from_the_job_wide_list() -> None:
    assert core_for_rank("0-1", 1, 2) == "1"
    assert core_for_rank("4-7", 2, 4) == "6"
    assert core_for_rank("0,2", 1, 2) == "2"
    assert core_for_rank("3", 0, 2) is None  # already one core
    assert core_for_rank("0-3", 0, 1) is None  # a single process per node keeps what it was given
    with pytest.raises(ValueError, match=r"NEURON_RT_VISIBLE_CORES='0-1' lists 2 core\(s\).*local rank 2"):
        core_for_rank("0-1", 2, 4)


def test_multi_neuron_and_dynamo_neuron_exist(unpatched) -> None:
    from accelerate.utils.dataclasses import DistributedType, DynamoBackend

    assert DistributedType("MULTI_NEURON") == "MULTI_NEURON"
    assert DynamoBackend("NEURON") == "NEURON"
    assert "MULTI_NEURON" in [m.value for m in DistributedType]
    record = _record("accelerate.utils.dataclasses.DistributedType.MULTI_NEURON#map")
    if record is not None and record.status == "applied":  # a release without MULTI_NEURON: ours, and it reverts
        with unpatched():
            with pytest.raises(ValueError):
                DistributedType("MULTI_NEURON")
        assert DistributedType("MULTI_NEURON") == "MULTI_NEURON"
    else:  # upstream defines both; the backfill stood aside
        assert has_native_member(DistributedType, "MULTI_NEURON")
        assert has_native_member(DynamoBackend, "NEURON")


def test_config_default_writes_a_neuron_config(tmp_path: Path, unpatched) -> None:
    from accelerate.commands.config import default, load_config_from_file

    path = tmp_path / "default_config.yaml"
    assert default.write_basic_config(save_location=str(path))
    config = load_config_from_file(str(path))
    assert config.distributed_type == "MULTI_NEURON"
    assert config.num_processes == torch.neuron.device_count() == 2
    assert config.use_cpu is False
    assert config.dynamo_config == {"dynamo_backend": "NEURON"}

    with unpatched():
        stock_path = tmp_path / "stock.yaml"
        default.write_basic_config(save_location=str(stock_path))
    stock = json.loads(stock_path.read_text())
    # Stock 1.10 writes a CPU config; 1.15 writes MULTI_NEURON but never the neuron compiler.
    assert stock["distributed_type"] != "MULTI_NEURON" or "dynamo_backend" not in stock.get("dynamo_config", {})


def test_questionnaire_offers_multi_neuron_and_the_neuron_compiler(tmp_path: Path, monkeypatch) -> None:
    from accelerate.commands.config import config as config_cli
    from accelerate.commands.config import load_config_from_file
    from accelerate.commands.menu import BulletMenu

    picks = {"Which type of machine": "multi-NEURON", "compute environment": "This machine"}
    typed = {"torch dynamo": "yes", "How many different machines": "1", "should be used for distributed training": "2"}
    menus: dict[str, tuple[list[str], int]] = {}

    def run(self: BulletMenu, default_choice: int = 0) -> int:
        menus[self.prompt] = (list(self.choices), default_choice)
        for question, label in picks.items():
            if question in self.prompt:
                return self.choices.index(label)
        return default_choice

    monkeypatch.setattr(BulletMenu, "run", run)
    monkeypatch.setattr("builtins.input", lambda prompt="": next((v for k, v in typed.items() if k in prompt), ""))

    path = tmp_path / "answers.yaml"
    config_cli.config_command(argparse.Namespace(config_file=str(path)))

    dynamo_choices, dynamo_default = next(v for k, v in menus.items() if "dynamo backend" in k)
    assert dynamo_choices[dynamo_default] == "neuron"  # accepted with Enter
    config = load_config_from_file(str(path))
    assert config.distributed_type == "MULTI_NEURON"
    assert config.num_processes == 2
    assert config.dynamo_config["dynamo_backend"] == "NEURON"
    assert config.use_cpu is False


def test_launch_arguments_start_one_process_per_core(tmp_path: Path, monkeypatch) -> None:
    from accelerate.commands import config as config_pkg
    from accelerate.commands import launch
    from accelerate.commands.config import default

    config_file = tmp_path / "default_config.yaml"
    default.write_basic_config(save_location=str(config_file))
    parser = launch.launch_command_parser()

    args, _, _ = launch._validate_launch_command(parser.parse_args(["--config_file", str(config_file), "train.py"]))
    assert args.multi_gpu and int(args.num_processes) == 2
    env = launch.prepare_multi_gpu_env(args)
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "NEURON"
    assert args.nproc_per_node == "2"
    assert "NEURON_RT_VISIBLE_CORES" not in env  # each rank's process group picks LOCAL_RANK

    # --gpu_ids selects Neuron cores; --dynamo_backend accepts neuron.
    argv = ["--config_file", str(config_file), "--gpu_ids", "0,1", "--dynamo_backend", "neuron", "train.py"]
    args, _, _ = launch._validate_launch_command(parser.parse_args(argv))
    env = launch.prepare_multi_gpu_env(args)
    assert env["NEURON_RT_VISIBLE_CORES"] == "0,1"
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "NEURON"

    # No config at all: one process per visible core.
    missing = str(tmp_path / "none.yaml")
    monkeypatch.setattr(launch, "default_config_file", missing)
    monkeypatch.setattr(config_pkg, "default_config_file", missing)
    args, _, _ = launch._validate_launch_command(parser.parse_args(["train.py"]))
    assert args.multi_gpu and args.num_processes == 2


def test_single_process_accelerator_uses_the_neuron_device(unpatched) -> None:
    from accelerate.state import AcceleratorState, PartialState

    def device_type() -> str:
        AcceleratorState._reset_state(True)
        try:
            return PartialState().device.type
        finally:
            AcceleratorState._reset_state(True)

    assert device_type() == "neuron"
    record = _record("accelerate.state.PartialState.default_device")
    if record is not None and record.status == "applied":
        with unpatched():
            assert device_type() == "cpu"  # accelerate <= 1.12 knows no Neuron


def test_bf16_autocast_under_multi_neuron(monkeypatch, unpatched) -> None:
    import types

    import accelerate.state
    import accelerate.utils.modeling as modeling
    from accelerate.utils.dataclasses import DistributedType

    # The state of a rank of a bf16 MULTI_NEURON job (a real one needs a process group).
    state = types.SimpleNamespace(
        distributed_type=DistributedType("MULTI_NEURON"), mixed_precision="bf16", device=torch.device("neuron", 0)
    )
    monkeypatch.setattr(accelerate.state, "AcceleratorState", lambda: state)
    monkeypatch.setattr(modeling, "AcceleratorState", lambda: state)

    def autocast_dtype() -> torch.dtype:
        with modeling.get_mixed_precision_context_manager(native_amp=True):
            assert torch.is_autocast_enabled("neuron")
            return torch.get_autocast_dtype("neuron")

    assert autocast_dtype() == torch.bfloat16
    record = _record("accelerate.utils.modeling.get_mixed_precision_context_manager")
    if record is not None and record.status == "applied":
        with unpatched():
            assert autocast_dtype() != torch.bfloat16  # 1.10: the device's default autocast dtype


# ------------------------------------------------------------------ as a user runs them


@pytest.mark.slow
def test_accelerate_launch_two_processes(tmp_path: Path) -> None:
    """The config of `accelerate config default` + `accelerate launch --config_file`: rank r on core r, DDP,
    the single-process loss."""
    from accelerate.commands.config import default

    # What `accelerate config default --config_file` writes (test_config_default_writes_a_neuron_config).
    config_file = tmp_path / "default_config.yaml"
    default.write_basic_config(save_location=str(config_file))
    # The user restricted the job to cores 0-1: every rank inherits the range (upstream: all on core 0).
    env = {"NEURON_RT_VISIBLE_CORES": "0-1"}

    out = tmp_path / "out"
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(config_file), "--main_process_port", "0"]
    run_launcher([*launch, str(SCRIPTS / "accelerate_train.py"), str(out)], cores=2, **env)
    reports = _reports(out, 2)

    _assert_own_cores(reports)
    reference = accelerate_train.reference(2, torch.device("neuron", 0))
    for report in reports:
        assert report["distributed_type"] == "MULTI_NEURON"
        assert report["num_processes"] == 2
        assert report["wrapped_in"] == "DistributedDataParallel"
        assert report["compiled"]  # dynamo backend NEURON from the config
        assert report["compiles"] + report["compile_cache_hits"] > 0
        assert report["reduce_sum"] == 3.0
        assert report["gather"] == [1.0, 2.0]
        assert report["rng_draws"][:2] == report["rng_draws"][2:]  # synchronize_rng_states
        assert report["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for got, want in zip(report["weights"], reference["weights"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # Both ranks run the same graphs and share the host's NEFF cache: each graph is compiled once for the job.
    assert reports[0]["graph_keys"] == reports[1]["graph_keys"]
    assert reports[0]["compiles"] + reports[1]["compiles"] == len(set(reports[0]["graph_keys"]))
    handed = sum(len(r["graph_keys"]) for r in reports)
    assert sum(r["compile_cache_hits"] for r in reports) == handed - len(set(reports[0]["graph_keys"]))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 key/value heads: divisible by every TP degree used here.
    return tiny.save_pretrained(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", num_key_value_heads=4)


@pytest.fixture(scope="module")
def single_process(tiny_model_dir: Path) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).to("neuron:0")
    try:
        return tp_step.step(model)
    finally:
        del model


def _distributed_config_has_sizes() -> bool:
    import transformers

    config_cls = getattr(transformers, "DistributedConfig", None)
    return config_cls is not None and {"tp_size", "fsdp_size"} <= {f.name for f in dataclasses.fields(config_cls)}


def _assert_matches(reports: list[dict], reference: dict) -> None:
    for report in reports:
        assert report["dtensor_params"] > 0, report
        for key in ("loss0", "loss1", "logits_sum"):
            assert report[key] == pytest.approx(reference[key], rel=1e-4), (key, report)
        assert report["logits_head"] == pytest.approx(reference["logits_head"], rel=1e-4, abs=1e-5)


def _torchrun(nproc: int, model_dir: Path, out: Path, tp: int, fsdp: int, **env: str) -> list[dict]:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPTS / "tp_step.py")]
    run_launcher([*cmd, str(model_dir), str(out), str(tp), str(fsdp)], cores=nproc, **env)
    return _reports(out, nproc)


@pytest.mark.slow
def test_notebook_launcher_two_processes(tmp_path: Path) -> None:
    """notebook_launcher (forked ranks, as from a notebook): rank r on core r, collectives, DDP in sync.

    Issue 14 reported it taking over 120 s with the plugin active; on the simulator it takes seconds on both
    version pairs. The subprocess timeout is only a hang guard: a hang fails the test instead of the suite.
    """
    run_launcher([str(BIN / "python"), str(SCRIPTS / "notebook_train.py"), str(tmp_path)], cores=2)
    reports = _reports(tmp_path, 2)
    _assert_own_cores(reports)
    assert all(r["distributed_type"].endswith("MULTI_NEURON") for r in reports), reports
    assert all(r["gathered"] == [1.0, 1.0, 2.0, 2.0] for r in reports), reports
    assert reports[0]["param_sum"] == reports[1]["param_sum"]  # different data per rank, weights kept in sync


@pytest.mark.slow
def test_torchrun_tensor_parallel_two_processes(tmp_path: Path, tiny_model_dir: Path, single_process: dict) -> None:
    """TP=2: DistributedConfig(tp_size=2) (Transformers 5) / tp_plan="auto" (4.57), cores 0-1 exported job-wide."""
    reports = _torchrun(2, tiny_model_dir, tmp_path, tp=2, fsdp=1, NEURON_RT_VISIBLE_CORES="0-1")
    _assert_own_cores(reports)
    assert all(r["world_size"] == 2 for r in reports)
    _assert_matches(reports, single_process)


@pytest.mark.slow
def test_torchrun_four_processes(tmp_path: Path, tiny_model_dir: Path, single_process: dict) -> None:
    """TP=2 x FSDP=2 where DistributedConfig has fsdp_size (Transformers 5); TP=4 with tp_plan on 4.57."""
    tp, fsdp = (2, 2) if _distributed_config_has_sizes() else (4, 1)
    reports = _torchrun(4, tiny_model_dir, tmp_path, tp=tp, fsdp=fsdp)
    _assert_own_cores(reports)
    assert all(r["world_size"] == 4 for r in reports)
    _assert_matches(reports, single_process)


@pytest.mark.slow
@pytest.mark.one_pair
def test_a_rank_that_dies_ends_the_job_with_an_error_not_a_hang(tmp_path: Path) -> None:
    """Rank 1 exits mid-job without a word; rank 0 is waiting in the gradient all-reduce. The launcher
    must notice, stop rank 0 and exit non-zero, naming the rank, within a bounded time."""
    import time

    from accelerate.commands.config import default

    config_file = tmp_path / "default_config.yaml"
    default.write_basic_config(save_location=str(config_file))
    out = tmp_path / "out"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config_file), "--main_process_port", "0"]
    started = time.monotonic()
    # a hang fails at the timeout; the bound asserted below is tighter
    proc = run_launcher([*cmd, str(SCRIPTS / "rank_dies.py"), str(out)], cores=2, timeout=300, check=False)
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert elapsed < 120, f"the job took {elapsed:.0f} s to give up:\n{output[-4000:]}"
    assert "exitcode: 7" in output and "rank: 1" in output, output[-4000:]  # torch elastic's failure summary
    assert (out / "rank1.steps").read_text().split() == ["0", "1"]
    assert (out / "rank0.steps").read_text().split() == ["0", "1"]  # step 2's all-reduce never completed


@pytest.mark.slow
@pytest.mark.one_pair
def test_without_a_launcher_the_surviving_rank_raises_when_its_peer_dies(tmp_path: Path) -> None:
    """Ranks started by hand (a scheduler's srun/mpirun, no torch elastic agent to stop the others): the
    survivor's all-reduce fails within seconds with the collective's error, it does not wait for a timeout.

    The simulated collectives run over gloo's TCP transport, which sees the dead peer's socket close; on
    Trainium they run over the Neuron runtime's collectives, whose dead-peer behaviour only hardware shows.
    """
    import subprocess
    import time

    from helpers import REPO, clean_env, free_port

    port = free_port()
    out = tmp_path / "out"
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "rank_dies.py"), str(out)],
            env=clean_env(
                ACCELERATE_NEURON_SIMULATE="2", OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), **common
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
        )
        for r in (0, 1)
    ]
    results = [p.communicate(timeout=300) for p in ranks]
    elapsed = time.monotonic() - started
    assert ranks[1].returncode == 7, results[1][1][-4000:]
    assert ranks[0].returncode not in (0, None), results[0][1][-4000:]
    assert elapsed < 120, f"rank 0 took {elapsed:.0f} s to fail"
    assert "Connection reset by peer" in results[0][1] or "Connection closed by peer" in results[0][1], results[0][1][
        -4000:
    ]
    assert (out / "rank0.steps").read_text().split() == ["0", "1"]
