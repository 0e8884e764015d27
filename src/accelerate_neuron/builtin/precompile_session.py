"""One process's warm-up: which shard it is, which shapes it has seen, and the progress it reports.

``accelerate-neuron precompile --jobs N -- CMD`` starts CMD N times with
``ACCELERATE_NEURON_PRECOMPILE=i/N``. Every worker runs the same script, so each
meets the same shapes in the same order; a worker compiles only the shapes whose
index (order of first appearance) is ``i`` modulo ``N``, and returns at once for
the others. Progress goes, one JSON object per line, to the file named by
``ACCELERATE_NEURON_PRECOMPILE_PROGRESS`` (the parent reads it for its bar and
summary). When CMD is a launcher, every rank of a worker is such a process: each
counts the shapes it meets itself, and its events carry its rank. The Python
API (:func:`accelerate_neuron.precompile`) opens a session of one shard
in-process with :func:`warming_up`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import settings

logger = logging.getLogger(__name__)

PRECOMPILE_ENV = settings.env_name("precompile")
PROGRESS_ENV = settings.env_name("precompile_progress")
SCRATCH_ENV = settings.env_name("precompile_scratch")


@dataclass
class Session:
    """The warm-up of one process: shard ``index`` of ``count``."""

    index: int = 0
    count: int = 1
    progress: str | None = None
    scratch: str | None = None
    seen: dict[str, int] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, kind: str, shape: dict[str, Any], graphs: int) -> bool:
        """Whether this process warms up ``shape`` now: new, and in its shard. Reports it either way once.

        ``graphs``: how many graphs the shape compiles at most (priced by the cost model for the ETA).
        """
        signature = _signature(kind, shape)
        with self.lock:
            if signature in self.seen:
                return False
            index = len(self.seen)
            self.seen[signature] = index
            mine = index % self.count == self.index
        self.emit({"event": "found", "index": index, "kind": kind, "shape": shape, "graphs": graphs, "mine": mine})
        if mine:
            self.ran.append(signature)
        return mine

    def owns(self, kind: str, shape: dict[str, Any]) -> bool:
        """Whether this process warmed ``shape`` up (so its graph is compiled here already)."""
        return _signature(kind, shape) in self.ran

    def done(self, kind: str, shape: dict[str, Any], seconds: float) -> None:
        signature = _signature(kind, shape)
        self.emit({"event": "done", "index": self.seen.get(signature), "kind": kind, "seconds": round(seconds, 3)})

    def emit(self, event: dict[str, Any]) -> None:
        """Append one event to the progress file (a line per event, written whole: the parent reads as it goes)."""
        if not self.progress:
            return
        line = json.dumps(
            {**event, "shard": self.index, "rank": _rank(), "pid": os.getpid(), "time": time.time()}, default=str
        )
        try:
            with open(self.progress, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:  # progress is for the bar; the warm-up itself goes on
            logger.debug("accelerate_neuron: precompile progress not written (%s)", exc)


def _signature(kind: str, shape: dict[str, Any]) -> str:
    return json.dumps({"kind": kind, **shape}, sort_keys=True, default=str)


def _rank() -> int:
    """This process's rank in a launched job (torchrun / accelerate launch set RANK), 0 otherwise."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


_lock = threading.Lock()
_session: Session | None = None
_from_env_read = False


def current() -> Session | None:
    """This process's warm-up session, or None (the script runs for real)."""
    global _session, _from_env_read
    with _lock:
        if _session is None and not _from_env_read:
            _from_env_read = True
            shard = settings.get("precompile")
            if shard is not None:
                _session = Session(
                    *shard, settings.get("precompile_progress") or None, settings.get("precompile_scratch") or None
                )
        return _session


def requested() -> bool:
    """Whether the environment asks for a warm-up (read without raising: the plugin's hook calls this)."""
    return settings.get_quietly("precompile") is not None


@contextlib.contextmanager
def warming_up(session: Session | None = None) -> Iterator[Session]:
    """Run the block as a warm-up (the Python API): one shard, nothing reported to a file unless asked."""
    global _session
    with _lock:
        previous = _session
        _session = session or Session()
    try:
        yield _session
    finally:
        with _lock:
            _session = previous


class Skip(Exception):
    """Raised inside upstream's generate loop to leave a call whose shape is another worker's, or seen already."""
