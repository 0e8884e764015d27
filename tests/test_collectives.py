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
