"""c10d collectives of the simulated ``"neuron"`` backend on 2 ranks, batched into one job.

``all_gather_into_tensor`` with a 2-D+ input and a flat output (what ``accelerator.gather`` uses) once
failed: the flat output went to gloo's ``_allgather_base`` unchanged. Output and input are now viewed
as per-rank chunks, as ProcessGroupNCCL does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_ddp_fsdp import _torchrun


@pytest.mark.slow
def test_every_collective_over_shapes_and_dtypes(tmp_path: Path) -> None:
    _torchrun("collectives.py", str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["failed"] == []
        # 4 shapes x 3 dtypes x 7 ops, all_to_all(_single) skipped for 0-D (12 x 7 + 9 x 2), + barrier
        assert len(report["checked"]) == 12 * 7 + 9 * 2 + 1


@pytest.mark.slow
def test_a_collective_that_finishes_while_a_rank_exits_does_not_abort_it(tmp_path: Path) -> None:
    """Rank 0 leaves with an all_gather in flight; its gloo thread frees the finished work while the interpreter
    finalizes (tests/scripts/exit_during_collective.py). Before the simulator held its host aliases
    (``_HeldAliases``) that took the GIL and rank 0 died with SIGABRT every time."""
    _torchrun("exit_during_collective.py", str(tmp_path))  # fails with both ranks' output unless both exit 0
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The 256 KiB of the first all_reduce are given back; only the live tensor remains.
        assert report["after"] - report["baseline"] == report["small_bytes"], report
        assert report["given_back_after"] is not None, report  # within 20 collectives
        # Held are the collectives gloo's threads have not finished freeing, not one per call: only the newest
        # once they caught up.
        assert report["held_after_100"] <= 10, report
        assert report["held_settled"] <= 1, report
