"""The proof that ``accelerate-neuron precompile`` started this process, so warm-up mode is never on by accident.

Warm-up mode makes ``generate()`` return stand-ins (the prompt, then pad tokens): a variable left
behind in a shell or a job file (``ACCELERATE_NEURON_PRECOMPILE=1``) would quietly do that to a real
run. So the command, for as long as it runs, keeps a token file in its private scratch folder (0600,
in a 0700 folder it removes when it ends) holding a random token and its own process id, and hands
the token to its workers in ``ACCELERATE_NEURON_PRECOMPILE_TOKEN``. A process is a warm-up worker
only if the token matches that file and the command that wrote it is one of its ancestors (a launcher's
ranks are its grandchildren). Variables copied from a worker, or left by a command that was killed,
prove nothing: the file is gone, or its writer no longer runs this process.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

from . import files, trust

#: In the command's scratch folder (``ACCELERATE_NEURON_PRECOMPILE_SCRATCH``).
TOKEN_FILE = ".accelerate-neuron-precompile-token"


def _started(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def write(scratch: str | os.PathLike[str]) -> str:
    """Create the token file in ``scratch`` (the command's own folder) and return the token for its workers."""
    token = secrets.token_hex(16)
    record = {"token": token, "pid": os.getpid(), "started": _started(os.getpid())}
    fd = files.create_new(Path(scratch) / TOKEN_FILE, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    return token


def why_not(token: str, scratch: str) -> str | None:
    """Why ``token`` and ``scratch`` do not prove that a running ``precompile`` started this process, or None."""
    if not token or not scratch:
        return "it was not set by `accelerate-neuron precompile` (no token)"
    try:
        record = json.loads(trust.read_file(Path(scratch) / TOKEN_FILE, limit=4096))
        pid, started, expected = int(record["pid"]), float(record["started"]), str(record["token"])
    except FileNotFoundError:
        return "the `accelerate-neuron precompile` run that set it has ended (its token file is gone)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its token file is refused ({exc})"
    if not hmac.compare_digest(expected, token):
        return "its token does not match the one of the `accelerate-neuron precompile` run named"
    import psutil

    try:
        ancestors = psutil.Process().parents()
    except psutil.Error as exc:
        return f"this process's ancestors cannot be read ({exc})"
    for parent in ancestors:
        try:
            if parent.pid == pid and abs(parent.create_time() - started) < 1.0:
                return None
        except psutil.Error:
            continue
    return f"the `accelerate-neuron precompile` run that set it (pid {pid}) did not start this process"
