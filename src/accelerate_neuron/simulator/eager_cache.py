"""Eager op signatures against the NEFF cache: which ones this process compiled, which it loaded.

On Neuron, eager mode compiles each (op, shapes, dtypes) into its own NEFF through the same
compilation cache as ``torch.compile`` graphs, persistent tier included (torch-neuronx's
``OperationExecutionEngine`` -> ``CompilationCache::GetOrCompileNeff`` in its sources as
indexed, and the Neuron docs' "eager mode and torch.compile use the same artifact
hierarchy"; unverified on trn2). So a warm cache spares eager compiles too.

The simulator records signatures in C++ as ops run; settling them against the cache is
deferred to the next :func:`accelerate_neuron.simulator.stats` call, ``reset_stats()`` or
process exit, whichever comes first. The counts are the same as if each op had been looked
up when it first ran: two processes settling the same signatures take one lock, so the
first compiles and the other loads, as two ranks racing for the same op would.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..compile_cache import keys as compile_keys
from . import graph_key, neff_cache

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: Signature -> "hit" | "miss", for the signatures seen since the last reset, against ``_settled_in``.
_settled: dict[str, str] = {}
_settled_in: neff_cache.NeffCache | None = None
_atexit_registered = False


def settle(signatures: Iterable[str]) -> tuple[int, int]:
    """Look up the signatures not settled yet; return (hits, misses) among ``signatures``."""
    global _settled_in
    wanted = list(signatures)
    cache = neff_cache.current()
    with _lock:
        if cache is not _settled_in:  # another cache was put in place (tests, benchmarks): look up afresh
            _settled.clear()
            _settled_in = cache
        new = [s for s in wanted if s not in _settled]
        if new:
            keys = {graph_key.eager_key(s): s for s in new}
            try:
                results = {key: lookup.status for key, lookup in cache.settle(_entries(keys)).items()}
            except Exception as exc:  # never break stats(): they then count as compiled
                logger.warning("accelerate_neuron: NEFF cache lookup of eager ops failed (%s)", exc)
                results = dict.fromkeys(keys, neff_cache.MISS)
            for key, status in results.items():
                _settled[keys[key]] = status
        hits = sum(1 for s in wanted if _settled.get(s) == neff_cache.HIT)
    return hits, len(wanted) - hits


def _entries(keys: dict[str, str]) -> dict[str, Callable[[], dict[str, Any]]]:
    """What each new eager entry records: the signature (its key's preimage) and the versions."""
    return {key: functools.partial(_entry, sig) for key, sig in keys.items()}


def _entry(signature: str) -> dict[str, Any]:
    return {
        "what": "eager",
        "signature": signature,
        **graph_key.versions(),
        "key_inputs": compile_keys.key_inputs(simulated=True),
    }


def forget() -> None:
    """After ``reset_stats()``: a signature seen again is looked up again (then found: it was compiled)."""
    with _lock:
        _settled.clear()


def settle_at_exit(read_signatures: Callable[[], list[str]]) -> None:
    """Settle what the process ran when it exits, so a later run finds it (registered once)."""
    global _atexit_registered
    with _lock:
        if _atexit_registered:
            return
        _atexit_registered = True

    def _at_exit() -> None:
        try:
            settle(read_signatures())
        except Exception as exc:  # at exit nothing may raise into the interpreter's shutdown
            logger.debug("accelerate_neuron: eager signatures not settled at exit: %s", exc)
        try:  # what settling compiled goes to the remote tier too (its own exit hook may have run already)
            from ..compile_cache import tier

            tier.flush_all()
        except Exception as exc:
            logger.debug("accelerate_neuron: remote compile cache not flushed at exit: %s", exc)

    atexit.register(_at_exit)
