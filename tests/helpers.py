"""Helpers shared by the tests: subprocess runs as a user would do them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clean_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a child process: no simulator unless asked, offline hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_NEURON_", "NEURON_RT_"))}
    for key in ("ACCELERATE_NEURON_CACHE_DIR",):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


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
