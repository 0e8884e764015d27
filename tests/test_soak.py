"""A short soak: ``benchmarks/soak.py`` with few calls, on the patched plugin (the long run is in RESULTS.md).

Cycling through a few distinct batches, every shape is seen in warm-up: after it nothing compiles. After
every ``generate()`` call the core holds exactly the weights (plus Transformers 4.x's kept static cache);
after the first Trainer step, exactly weights + optimizer state + the step's batch. Host RSS stays within
a stated bound: 64 MiB over the calls after warm-up (the long run stays within about 25 MiB).
"""

from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO, clean_env

RSS_BOUND = 64 * 2**20


@pytest.mark.slow
@pytest.mark.one_pair
def test_short_soak_keeps_memory_and_compiles_flat() -> None:
    import subprocess

    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--modes", "patched", "--json"]
    cmd += ["--calls", "24", "--warmup", "12", "--distinct", "4", "--steps", "40", "--train-warmup", "20"]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["patched"]

    gen = result["generate"]
    assert gen["calls"] == 24
    assert gen["calls_with_leak"] == 0 and gen["leaked_bytes_max"] == 0, gen
    assert gen["compiled_after_warmup"] == 0, gen
    assert gen["graphs"] > 0  # the plugin compiled the prefill and the decode step
    assert gen["rss_max"] - gen["rss_after_warmup"] < RSS_BOUND, gen

    train = result["train"]
    assert train["steps"] == 40
    assert train["memory_moves_after_first_step"] == 0, train
    assert train["compiled_after_warmup"] == 0, train
    assert train["rss_max"] - train["rss_after_warmup"] < RSS_BOUND, train
