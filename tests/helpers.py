"""Helpers shared by the tests: subprocess runs as a user would do them."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_NEFF_ROOT: Path | None = None


def fresh_neff_cache_dir() -> str:
    """An empty NEFF cache folder (removed when the test process exits): a cold cache, as on a new machine."""
    global _NEFF_ROOT
    if _NEFF_ROOT is None:
        _NEFF_ROOT = Path(tempfile.mkdtemp(prefix="accelerate-neuron-test-neff-"))
        atexit.register(shutil.rmtree, _NEFF_ROOT, True)
    return tempfile.mkdtemp(dir=_NEFF_ROOT)


def clean_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a child process: no simulator unless asked, offline hub, a cold NEFF cache of its own.

    Every child gets an empty ``TORCH_NEURONX_NEFF_CACHE_DIR`` (all processes it starts share it, as the
    ranks of one job on one host do), so its compile counts never depend on another test. A test that
    wants a warm cache passes the same folder to two children.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_NEURON_", "NEURON_RT_"))}
    for key in ("ACCELERATE_NEURON_CACHE_DIR", "ACCELERATE_NEURON_SIM_ASAN"):  # ASan: the children's build too
        if key in os.environ:
            env[key] = os.environ[key]
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("TORCH_NEURONX_NEFF_DISABLE_CACHE", None)
    env["TORCH_NEURONX_NEFF_CACHE_DIR"] = fresh_neff_cache_dir()
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_launcher(
    cmd: list[str], *, cores: int, timeout: float = 900, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """Run a launcher command (torchrun, accelerate launch, ...) on ``cores`` simulated cores; fail with its output
    (``check=False``: return the failed process, for a job that must fail).

    The launchers pick a free port, release it, then bind it: another test's process (gloo binds ephemeral
    ports) can take it in between. That is the test machine, not the code under test, so it gets one more
    try; any other failure fails at once.
    """
    for attempt in range(2):
        proc = subprocess.run(
            cmd,
            env=clean_env(ACCELERATE_NEURON_SIMULATE=str(cores), OMP_NUM_THREADS="1", **env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(REPO),
        )
        if proc.returncode == 0 or attempt or "address already in use" not in proc.stderr.lower():
            break
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def run_python(
    code: str, *, timeout: float = 600, check: bool = True, **env: str | None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with :func:`clean_env` (``env`` overrides it)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


def last_json(stdout: str) -> dict:
    """The last line of ``stdout`` that parses as JSON (children print their result last)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in child output:\n{stdout}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_under_simulate(
    model: str, cores: int, cache: str | Path, env: dict[str, str]
) -> tuple[subprocess.Popen, int]:
    """`accelerate-neuron simulate --json -- transformers serve MODEL --continuous-batching` on a free local port,
    returned (the process, its port) once it answers ``/health``. Its own session: stop it with ``os.killpg``.

    stdout is simulate's JSON report, stderr the server's output; ``cache`` is its NEFF cache folder.
    """
    import time
    import urllib.request

    port = free_port()
    simulate = [sys.executable, "-m", "accelerate_neuron", "simulate", "--cores", str(cores), "--json", "--"]
    serve = [str(Path(sys.executable).with_name("transformers")), "serve", model, "--continuous-batching"]
    server = subprocess.Popen(
        [*simulate, *serve, "--host", "127.0.0.1", "--port", str(port)],
        env=clean_env(TORCH_NEURONX_NEFF_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while True:
        assert server.poll() is None, server.stderr.read()[-4000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return server, port
        except OSError:
            assert time.monotonic() < deadline, "the server did not start in 10 minutes"
            time.sleep(1)
