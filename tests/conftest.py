"""Test session setup: every test runs against the simulated Neuron device.

The pytest process itself runs with a 2-core simulated device installed on
``import torch`` (``ACCELERATE_NEURON_SIMULATE=2``), as a user's script would.
Tests that need another core count, no Neuron at all, or several processes
run a subprocess (``helpers.run_python``).

Compile counts assume a cold NEFF cache: each test, and each child process a
test starts, gets an empty one (``neff_cache.temporary``, ``helpers.clean_env``).
"""

from __future__ import annotations

import os

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import fresh_neff_cache_dir

# The simulator's default NEFF cache persists across runs: the session gets an empty one instead.
os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = fresh_neff_cache_dir()
os.environ.pop("TORCH_NEURONX_NEFF_DISABLE_CACHE", None)

import contextlib
from collections.abc import Iterator

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import activation, logs, simulator
from accelerate_neuron.simulator import neff_cache


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist each worker is one of N processes on N cores: torch's intra-op threads would only
    # oversubscribe them (the tiny models gain nothing from threads); the children tests start inherit it.
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding long tests (``slow``, ``one_pair``) first, each module's tests in their own order.

    Under ``-n 2`` a long multi-process test that starts last keeps one worker busy while the other has nothing
    left: started first, the short tests fill in around it. Modules stay whole (their module fixtures are built
    once)."""

    def module(item: pytest.Item) -> str:
        return getattr(getattr(item, "module", None), "__name__", "")

    long_modules = {module(item) for item in items if "slow" in item.keywords or "one_pair" in item.keywords}
    items.sort(key=lambda item: module(item) not in long_modules)


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


@pytest.fixture(autouse=True)
def _nothing_said_yet() -> None:
    """Warnings said once per process are said again in each test (each test asserts what it hears)."""
    logs.forget()


@pytest.fixture(autouse=True)
def _cold_neff_cache() -> Iterator[None]:
    """Every test starts on an empty NEFF cache: compile counts never depend on the tests before it."""
    with neff_cache.temporary():
        yield


_LEAKED_ENV = ("ACCELERATE_DYNAMO_", "ACCELERATE_MIXED")


@pytest.fixture(autouse=True)
def _restore_accelerate_env() -> Iterator[None]:
    """Transformers 4.x's ``TrainingArguments`` writes ACCELERATE_DYNAMO_* / ACCELERATE_MIXED_PRECISION into
    os.environ: without this, every later ``Accelerator()`` in the worker compiled its model or changed precision."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_LEAKED_ENV)}
    yield
    for key in [k for k in os.environ if k.startswith(_LEAKED_ENV)]:
        del os.environ[key]
    os.environ.update(saved)


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
