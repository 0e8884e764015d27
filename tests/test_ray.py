"""Ray Train on the simulated Neuron device, as a Ray user runs it: `accelerate-neuron simulate -- python train.py`.

Stock Ray Train gave a worker it assigned a Neuron core ``ACCELERATE_TORCH_DEVICE=cpu`` and a gloo process
group: the model stayed on the CPU and DDP failed on ``device_ids`` (issue 41). The slow test runs
``tests/scripts/ray_train.py`` (``ray.init()`` without resources, ``ScalingConfig(num_workers=2,
resources_per_worker={"neuron_cores": 1})``) under ``simulate``: the Trainer with Ray's default
``TorchConfig()`` then FSDP2 on the group Ray created, a resume from its ``ray.train.Checkpoint``, and an
Accelerate loop with ``TorchConfig(backend="neuron")``; then reads each worker's report and simulate's dry-run
report, which holds a record from every Ray worker (Ray ends them with ``ray.kill``, which runs nothing in them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from accelerate_neuron import patching
from accelerate_neuron.builtin import engines
from accelerate_neuron.builtin.launch import ray_workers
from helpers import REPO, clean_env, last_json

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import accelerate_train  # noqa: E402

STEPS, SAVE_AT = 4, 2  # as in scripts/ray_train.py


# ------------------------------------------------------------------ in-process


def test_ray_counts_the_simulated_cores_as_neuron_cores() -> None:
    """Ray finds Neuron cores with neuron-ls, which a simulated host lacks: the simulated cores are counted."""
    from ray._private.accelerators.neuron import NeuronAcceleratorManager

    from accelerate_neuron import activation

    key = "ray._private.accelerators.neuron.NeuronAcceleratorManager.get_current_node_num_accelerators"
    if {r.key: r.status for r in patching.records()}.get(key) != "applied":
        activation.reapply_patches()  # applied on import; again if a test's `unpatched` reverted it
    record = {r.key: r for r in patching.records()}[key]
    assert record.status == "applied" and record.plugin == "launch", record
    assert NeuronAcceleratorManager.get_current_node_num_accelerators() == 2  # the session's simulated cores
    assert NeuronAcceleratorManager.get_current_node_num_accelerators.__wrapped__() == 0  # no neuron-ls here


def test_outside_a_ray_worker_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray imported but not running (the driver before ray.init(), a script): the user's choices stand."""
    import ray

    assert not ray.is_initialized()
    assert engines.ray_neuron_cores() is None
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert engines.forced_torch_device() == "cpu"  # set by the user: their choice of device
    assert ray_workers.process_group_backend("gloo") == "gloo"  # asked for by the user
    assert ray_workers.process_group_backend("neuron") == "neuron"


def test_a_ray_worker_binds_the_core_ray_assigned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4,5")
    assert ray_workers.core_index(["5"]) == 1
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "2-3")
    assert ray_workers.core_index(["2", "3"]) == 0
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")  # RAY_EXPERIMENTAL_NOSET_NEURON_RT_VISIBLE_CORES=1
    assert ray_workers.core_index(["1"]) == 1


# ------------------------------------------------------------------ as a user runs it


def _ranks(folder: Path) -> list[dict]:
    files = sorted(folder.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], files
    return [json.loads(f.read_text()) for f in files]


def _simulate_ray_train(out: Path, *cases: str, cores: int, two_nodes: bool = False) -> tuple[dict, dict]:
    """``simulate --json -- python ray_train.py OUT CASES``: (simulate's report, the driver's summary)."""
    import subprocess

    command = [sys.executable, "-m", "accelerate_neuron", "simulate", "--cores", str(cores), "--json", "--"]
    script = [sys.executable, str(SCRIPTS / "ray_train.py"), *(["--two-nodes"] if two_nodes else []), str(out)]
    proc = subprocess.run(
        [*command, *script, *cases],
        env=clean_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    return last_json(proc.stdout), json.loads((out / "driver.json").read_text())


# Ray's side (builtin/engines.py) is the same on both pairs; Trainer and Accelerate across processes are tested on
# both pairs under torchrun (test_launch).
@pytest.mark.slow
@pytest.mark.one_pair
def test_ray_train_with_rays_defaults_trains_each_worker_on_its_own_core(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report, driver = _simulate_ray_train(out, "trainer", "resume", "accelerate", cores=2)
    assert (driver["cluster_neuron_cores"], driver["nodes"]) == (2, 1)  # ray.init() found the simulated cores

    # The Trainer, Ray's default TorchConfig(): Ray's gloo group became cpu:gloo,neuron:neuron.
    trainer = _ranks(out / "trainer")
    for rank, worker in enumerate(trainer):
        assert worker["ray_torch_device"] == "cpu", worker  # what Ray exported; the plugin trains on Neuron
        assert (worker["device"], worker["param_device"]) == ("neuron:0", "neuron:0"), worker
        assert worker["visible_cores_env"] == str(rank) and worker["physical_core"] == rank, worker
        assert worker["process_group"] == "cpu:gloo,neuron:neuron", worker
        assert len(worker["losses"]) == STEPS and worker["compiles"] > 0, worker
    # Each worker trained on its own data shard: equal weights mean the gradients were all-reduced.
    assert trainer[0]["weights"] == trainer[1]["weights"]
    assert trainer[0]["losses"] == trainer[1]["losses"]
    assert driver["trainer"] == {"error": None, "checkpoint_steps": [SAVE_AT, STEPS], "metrics_step": STEPS}
    # FSDP2 on the same group Ray created: the full weights equal DDP's on the CPU (the group's gloo part).
    for worker in trainer:
        for got, want in zip(worker["fsdp2"], worker["cpu_ddp"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert trainer[0]["fsdp2"] == trainer[1]["fsdp2"]

    # Resumed from the step-2 ray.train.Checkpoint: the dropout masks replayed, the same weights bitwise.
    resumed = _ranks(out / "resume")
    for worker, whole in zip(resumed, trainer, strict=True):
        assert worker["resumed"] and worker["physical_core"] == whole["physical_core"], worker
        assert worker["losses"] == whole["losses"]
        assert worker["weights"] == whole["weights"]

    # A plain Accelerate loop, TorchConfig(backend="neuron"): the single-process loss and weights.
    reference = accelerate_train.reference(2, torch.device("neuron", 0))
    loop = _ranks(out / "accelerate")
    assert [w["physical_core"] for w in loop] == [0, 1]
    for worker in loop:
        assert worker["process_group"] == "neuron" and worker["distributed_type"] == "MULTI_NEURON", worker
        assert worker["device"] == "neuron:0" and worker["wrapped_in"] == "DistributedDataParallel", worker
        assert (worker["reduce_sum"], worker["gather"]) == (3.0, [1.0, 2.0])
        assert worker["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for got, want in zip(worker["weights"], reference["weights"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)

    # simulate's report holds every worker's record (3 fits x 2 workers), each on the core Ray gave it.
    workers = report["processes"]
    assert len(workers) == 6, [(w["process"], w["pid"]) for w in workers]
    assert sorted(w["visible_cores"] for w in workers) == [[0]] * 3 + [[1]] * 3
    models = {(m["model"], core) for m in report["placement"] for core in m["bytes"]}
    assert {("GPT2LMHeadModel", "core 0"), ("GPT2LMHeadModel", "core 1")} <= models, models
    compiled = sum(w["compiles"] + w["compile_cache_hits"] for w in workers)
    assert compiled == sum(w["compiles"] for w in trainer + resumed) and report["distinct_graphs"] > 0


@pytest.mark.slow
@pytest.mark.one_pair
def test_ray_train_on_two_nodes_each_worker_on_its_nodes_core(tmp_path: Path) -> None:
    """Two Ray nodes on this machine (a head and a second raylet), one Neuron core each: the workers run on
    different nodes, each told core 0 of its own node; the plugin binds what Ray assigned, not LOCAL_RANK."""
    out = tmp_path / "out"
    report, driver = _simulate_ray_train(out, "trainer", cores=1, two_nodes=True)
    assert (driver["cluster_neuron_cores"], driver["nodes"]) == (2, 2)
    assert driver["trainer"]["error"] is None
    workers = _ranks(out / "trainer")
    for worker in workers:
        assert worker["visible_cores_env"] == "0" and worker["physical_core"] == 0, worker
        assert (worker["device"], worker["param_device"]) == ("neuron:0", "neuron:0"), worker
        assert worker["process_group"] == "cpu:gloo,neuron:neuron", worker
    assert workers[0]["weights"] == workers[1]["weights"] and len(workers[0]["losses"]) == STEPS
    assert report["processes_using_device"] == 2
