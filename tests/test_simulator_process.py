"""Simulator behaviour that needs a fresh process: visible cores, runtime init, shadowing, fork, c10d."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import clean_env, free_port, last_json, run_python

VISIBLE = """
import json, torch
n = torch.neuron.device_count()
print(json.dumps({"count": n, "initialized": torch.neuron.is_initialized(),
                  "physical": [torch.neuron.get_device_properties(i).physical_core for i in range(n)]}))
"""


@pytest.mark.parametrize(
    ("visible", "num", "count", "physical"),
    [
        ("2", None, 1, [2]),
        ("0-3", None, 4, [0, 1, 2, 3]),
        ("0,2", None, 2, [0, 2]),
        ("1-3", "2", 2, [1, 2]),
        (None, "3", 3, [0, 1, 2]),
    ],
)
def test_visible_cores_limit_and_renumber(
    visible: str | None, num: str | None, count: int, physical: list[int]
) -> None:
    out = last_json(
        run_python(
            VISIBLE, ACCELERATE_NEURON_SIMULATE="4", NEURON_RT_VISIBLE_CORES=visible, NEURON_RT_NUM_CORES=num
        ).stdout
    )
    assert out["count"] == count and out["physical"] == physical
    assert out["initialized"] is False  # counting cores does not start the runtime


@pytest.mark.parametrize(
    ("visible", "message"),
    [
        ("7", "core 7 does not exist; this host has 4 Neuron core(s), ids 0-3"),
        ("a-b", "'a-b' is not a core id"),
        ("3-1", "descending"),
    ],
)
def test_bad_visible_cores_are_clear_errors(visible: str, message: str) -> None:
    proc = run_python(
        "import torch; print('torch ok', hasattr(torch, 'neuron'))",
        ACCELERATE_NEURON_SIMULATE="4",
        NEURON_RT_VISIBLE_CORES=visible,
    )
    assert "torch ok False" in proc.stdout  # import torch survives; the device is not registered
    assert "NEURON_RT_VISIBLE_CORES" in proc.stderr and message in proc.stderr


def test_runtime_initialises_on_first_device_use_and_forks_are_refused() -> None:
    code = """
        import json, os, torch
        report = {"after_import": torch.neuron.is_initialized()}
        torch.neuron.device_count(); torch.neuron.current_device(); torch.neuron.memory_allocated(0)
        report["after_queries"] = torch.neuron.is_initialized()
        x = torch.ones(2, device="neuron")
        report["after_tensor"] = torch.neuron.is_initialized()
        pid = os.fork()
        if pid == 0:
            try:
                torch.ones(2, device="neuron")
                os._exit(0)
            except RuntimeError as exc:
                os._exit(3 if "forked subprocess" in str(exc) and "spawn" in str(exc) else 4)
        report["child_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps(report))
    """
    out = last_json(run_python(code, ACCELERATE_NEURON_SIMULATE="2").stdout)
    assert out == {"after_import": False, "after_queries": False, "after_tensor": True, "child_exit": 3}


def test_refuses_to_shadow_a_real_or_other_backend(tmp_path: Path) -> None:
    other = """
        import torch
        torch.utils.rename_privateuse1_backend("otherdev")
        from accelerate_neuron import simulator
        try:
            simulator.install(cores=2)
        except simulator.SimulatorError as exc:
            print("refused:", exc)
    """
    refusal = run_python(other).stdout
    assert "refused: cannot install the simulated Neuron device" in refusal
    assert "the PrivateUse1 backend is already registered as 'otherdev'" in refusal
    real = tmp_path / "torch_neuronx"
    real.mkdir()
    (real / "__init__.py").write_text("__version__ = '2.14.0'\n")  # importable: looks like the real package
    code = """
        import torch
        from accelerate_neuron import simulator
        try:
            simulator.install(cores=2)
        except simulator.SimulatorError as exc:
            print("refused:", exc)
    """
    assert "a real torch-neuronx is installed" in run_python(code, PYTHONPATH=str(tmp_path)).stdout


COLLECTIVES = """
import json, os, torch, torch.distributed as dist
dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("neuron", 0)
x = torch.full((4,), float(rank + 1), device=dev)
dist.all_reduce(x)
parts = [torch.empty(2, device=dev) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
b = torch.arange(3.0, device=dev) if rank == 0 else torch.zeros(3, device=dev)
dist.broadcast(b, src=0)
out = open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w")
out.write(json.dumps({"rank": rank, "visible": os.environ.get("NEURON_RT_VISIBLE_CORES"),
                  "backend": dist.get_backend(), "all_reduce": x.cpu().tolist(),
                  "all_gather": [p.cpu().tolist() for p in parts], "broadcast": b.cpu().tolist(),
                  "device": str(x.device), "physical": torch.neuron.get_device_properties(0).physical_core}))
out.close()
dist.destroy_process_group()
"""


def test_two_process_collectives(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            str(script),
        ],
        env=clean_env(ACCELERATE_NEURON_SIMULATE="2", RESULT_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # one file per rank: two ranks printing to one pipe can interleave their lines
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["backend"] == "neuron" and r["device"] == "neuron:0"
        assert r["visible"] == str(r["rank"]) and r["physical"] == r["rank"]  # one core per process
        assert r["all_reduce"] == [3.0] * 4
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["broadcast"] == [0.0, 1.0, 2.0]


def test_device_use_before_init_process_group_is_refused() -> None:
    code = f"""
        import os, torch, torch.distributed as dist
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        torch.ones(1, device="neuron")  # initialises this process's Neuron runtime
        try:
            dist.init_process_group("neuron")
            print("no error")
        except Exception as exc:
            print("refused:", type(exc).__name__, exc)
    """
    out = run_python(textwrap.dedent(code), ACCELERATE_NEURON_SIMULATE="2").stdout
    assert "refused:" in out and "initialised before init_process_group" in out
