"""DDP on the simulated device across 2 ranks, compared with the same job on CPU/gloo.

Each case once failed natively on ``neuron`` (a use-after-free of device storage behind the CPU
aliases collectives and the reducer run on): a comm hook aborted in ``_verify_params_across_processes``,
``join()`` over uneven inputs segfaulted in ``backward``. Children's output is kept on failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run_launcher

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _torchrun(script: str, *args: str, nproc: int = 2) -> None:
    run_launcher(
        [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPTS / script), *args], cores=nproc
    )


def _ranks(out: Path) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"]
    return [json.loads(f.read_text()) for f in files]


def _assert_matches_gloo(script: str, cases: tuple[str, ...], tmp_path: Path) -> None:
    """``script`` on 2 neuron ranks: every case runs, the ranks agree, and equals the same job on CPU/gloo."""
    _torchrun(script, str(tmp_path / "neuron"), "neuron")
    _torchrun(script, str(tmp_path / "cpu"), "cpu")
    neuron, cpu = _ranks(tmp_path / "neuron"), _ranks(tmp_path / "cpu")
    for case in cases:
        for rank in (0, 1):
            assert isinstance(cpu[rank][case], list), cpu[rank][case]  # the reference itself must run
            assert isinstance(neuron[rank][case], list), neuron[rank][case]  # the error, if any
        assert neuron[0][case] == neuron[1][case], case  # the ranks hold identical weights
        for got, want in zip(neuron[0][case], cpu[0][case], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), case


@pytest.mark.slow
def test_ddp_comm_hook_join_and_no_sync_match_gloo_on_cpu(tmp_path: Path) -> None:
    _assert_matches_gloo("ddp_checks.py", ("hook", "join", "no_sync"), tmp_path)


@pytest.mark.slow
def test_fsdp_v1_and_v2_match_gloo_on_cpu(tmp_path: Path) -> None:
    # FSDP v1 frees its unsharded flat parameter with storage().resize_(0) and set_()s a shard into it (the
    # simulator once moved that storage to the CPU); FSDP v2 shards DTensors over a device mesh.
    _assert_matches_gloo("fsdp_checks.py", ("fsdp1", "fsdp2"), tmp_path)


def test_storage_resized_to_zero_stays_on_its_core() -> None:
    """FSDP v1 frees the unsharded flat param with ``storage().resize_(0)``, then ``set_``s a shard into it."""
    import torch

    flat = torch.ones(8, device="neuron:1")
    flat.untyped_storage().resize_(0)
    assert flat.untyped_storage().device == torch.device("neuron", 1)
    assert flat.untyped_storage().nbytes() == 0
    shard = torch.arange(4.0, device="neuron:1")
    flat.set_(shard)
    assert flat.device == torch.device("neuron", 1) and flat.tolist() == [0.0, 1.0, 2.0, 3.0]
    flat.untyped_storage().resize_(16)
    assert flat.untyped_storage().device == torch.device("neuron", 1)
