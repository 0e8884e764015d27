"""One process's warm-up: which shard it is, which shapes it has seen, and the progress it reports.

``accelerate-neuron precompile --jobs N -- CMD`` starts CMD N times with
``ACCELERATE_NEURON_PRECOMPILE=i/N`` and a token that proves the command started it
(:mod:`accelerate_neuron.precompile_token`: the variable alone, left behind in a shell, is ignored
with a warning; warm-up mode, when on, is announced with a warning too, since ``generate()`` then
returns stand-ins). Every worker runs the same script, so each
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

from .. import logs, precompile_token, settings
from ..compile_cache import outcomes

logger = logging.getLogger(__name__)

PRECOMPILE_ENV = settings.env_name("precompile")
PROGRESS_ENV = settings.env_name("precompile_progress")
SCRATCH_ENV = settings.env_name("precompile_scratch")
TOKEN_ENV = settings.env_name("precompile_token")


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
        event = {"event": "done", "index": self.seen.get(signature), "kind": kind, "seconds": round(seconds, 3)}
        # This process's graph lookups so far, by outcome (compiled / remote / disk / memory): precompile's counts.
        self.emit({**event, "lookups": outcomes.snapshot()})

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


def labelled(kind: str, shape: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Entries compiled in the block say which warm-up, model and bucket made them (``accelerate-neuron cache ls``)."""
    rest = {k: v for k, v in shape.items() if k != "model"}
    return outcomes.labelled(warmup=kind, model=shape.get("model"), shape=rest)


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
_checked = False
_shard: tuple[int, int] | None = None


def _shard_from_environment() -> tuple[int, int] | None:
    """The shard the environment names, if ``accelerate-neuron precompile`` set it (else None, with a warning)."""
    global _checked, _shard
    if _checked:
        return _shard
    try:
        shard = settings.get("precompile")
    except ValueError as exc:
        logs.once(logger, ("warmup.invalid", str(exc)), "accelerate_neuron: %s; the script runs for real", exc)
        shard = None
    if shard is not None:
        reason = precompile_token.why_not(
            settings.get_quietly("precompile_token"), settings.get_quietly("precompile_scratch")
        )
        if reason is not None:
            logs.once(
                logger,
                ("warmup.ignored", reason),
                "accelerate_neuron: %s=%s is ignored: %s. The script runs for real; unset the variable (only "
                "`accelerate-neuron precompile` turns warm-up mode on).",
                PRECOMPILE_ENV,
                (settings.raw("precompile") or ("",))[0],
                reason,
            )
            shard = None
        else:
            logs.once(
                logger,
                "warmup.on",
                "accelerate_neuron: warm-up mode (accelerate-neuron precompile, worker %d of %d): generate() returns "
                "stand-ins (the prompt, then pad tokens), a Trainer runs one batch per shape, restores the weights "
                "and writes nothing; files this script writes itself get those stand-ins "
                "(accelerate_neuron.is_warming_up() tells the script).",
                shard[0] + 1,
                shard[1],
            )
    _checked, _shard = True, shard
    return shard


def current() -> Session | None:
    """This process's warm-up session, or None (the script runs for real)."""
    global _session, _from_env_read
    with _lock:
        if _session is None and not _from_env_read:
            _from_env_read = True
            shard = _shard_from_environment()
            if shard is not None:
                _session = Session(
                    *shard, settings.get("precompile_progress") or None, settings.get("precompile_scratch") or None
                )
        return _session


def requested() -> bool:
    """Whether ``accelerate-neuron precompile`` started this process as a warm-up worker (never raises)."""
    with _lock:
        return _shard_from_environment() is not None


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
