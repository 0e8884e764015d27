"""Test session setup: every test runs against the simulated Neuron device.

The pytest process itself runs with a 2-core simulated device installed on
``import torch`` (``ACCELERATE_NEURON_SIMULATE=2``), as a user's script would.
Tests that need another core count, no Neuron at all, or several processes
run a subprocess (``helpers.run_python``).
"""

from __future__ import annotations

import os

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import contextlib
from collections.abc import Iterator

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import activation, simulator


def pytest_report_header(config: pytest.Config) -> list[str]:
    import accelerate
    import transformers

    return [
        f"accelerate-neuron: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}",
        f"neuron device: {accelerate_neuron.status().devices}",
    ]


@pytest.fixture(scope="session", autouse=True)
def _simulated_device() -> None:
    assert simulator.is_installed(), (
        "the test session expects the simulated device (ACCELERATE_NEURON_SIMULATE=2); "
        f"status: {accelerate_neuron.status()}"
    )


@pytest.fixture
def sim() -> Iterator[object]:
    """The simulator module with its counters zeroed for this test."""
    simulator.reset_stats()
    yield simulator


#: Stock upstream on a (simulated) trn2: every patch reverted inside the block.
unpatched_upstream = activation.unpatched


@pytest.fixture
def unpatched() -> Iterator[contextlib.AbstractContextManager[None]]:
    """``with unpatched(): ...`` runs a block against stock upstream (the baseline)."""
    yield unpatched_upstream
    activation.reapply_patches()
