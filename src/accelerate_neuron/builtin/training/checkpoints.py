"""Resume never picks a half-written checkpoint.

Trainer writes a checkpoint folder in place: weights, optimizer, scheduler, RNG
states, and ``trainer_state.json`` last. A job killed in between (preempted,
OOM-killed, SIGKILL) leaves a ``checkpoint-N`` without a (complete)
``trainer_state.json``, and upstream's ``get_last_checkpoint`` (4.57 to 5.25)
returns the highest ``checkpoint-N`` whatever it holds: ``resume_from_checkpoint=True``
then fails on the missing file or, worse, loads a torn one. The wrapper returns
the newest *complete* checkpoint and names the ones it skipped.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("accelerate_neuron")

#: Written last by every Trainer release: its presence (and parsing) marks a finished checkpoint.
STATE_FILE = "trainer_state.json"
_warned: set[tuple[str, ...]] = set()


def incomplete(path: str) -> str | None:
    """Why the checkpoint folder ``path`` is not finished, or None when it is."""
    state = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state):
        return f"no {STATE_FILE}: the save was interrupted"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} unreadable ({type(exc).__name__}): the save was interrupted"
    return None


def skips_partial(original: Callable[..., Any]) -> str | None:
    """``needed`` probe: why the patch stands aside (upstream already skips a partial newest folder), else None."""
    with tempfile.TemporaryDirectory() as folder:
        for step in (1, 2):
            os.mkdir(os.path.join(folder, f"checkpoint-{step}"))
        with open(os.path.join(folder, "checkpoint-1", STATE_FILE), "w", encoding="utf-8") as f:
            f.write("{}")
        try:
            picked = original(folder)
        except Exception:  # a shape this probe does not know: let the wrapper decide per call
            return None
        if picked is not None and os.path.basename(picked) == "checkpoint-1":
            return "upstream get_last_checkpoint already skips a checkpoint folder without trainer_state.json"
    return None


def wrap_get_last_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    pattern = getattr(original, "__globals__", {}).get("_re_checkpoint")

    @functools.wraps(original)
    def get_last_checkpoint(folder: str, *args: Any, **kwargs: Any) -> Any:
        last = original(folder, *args, **kwargs)
        if last is None or pattern is None or incomplete(last) is None:
            return last
        steps = []
        for name in os.listdir(folder):
            match = pattern.search(name)
            if match is not None and os.path.isdir(os.path.join(folder, name)):
                steps.append((int(match.groups()[0]), name))
        skipped = []
        for _, name in sorted(steps, reverse=True):
            path = os.path.join(folder, name)
            reason = incomplete(path)
            if reason is None:
                _warn(folder, skipped, path)
                return path
            skipped.append(f"{name} ({reason})")
        _warn(folder, skipped, None)
        return None

    return get_last_checkpoint


def _warn(folder: str, skipped: list[str], picked: str | None) -> None:
    key = (folder, *skipped)
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "accelerate_neuron: in %s, skipped partial checkpoint(s) %s; %s. Delete the partial folder(s) once you "
        "no longer need them.",
        folder,
        ", ".join(skipped),
        f"resuming from {os.path.basename(picked)}" if picked else "no complete checkpoint is left to resume from",
    )
