"""Resume never picks a half-written checkpoint.

Trainer writes a checkpoint folder in place: weights, optimizer, scheduler, RNG
states, and ``trainer_state.json`` last. A job killed in between (preempted,
OOM-killed, SIGKILL) leaves a ``checkpoint-N`` without a (complete)
``trainer_state.json``, and upstream's ``get_last_checkpoint`` (4.57 to 5.25)
returns the highest ``checkpoint-N`` whatever it holds: ``resume_from_checkpoint=True``
then fails on the missing file or, worse, loads a torn one. The wrapper returns
the newest *complete* checkpoint and names the ones it skipped.

Accelerate's ``save_state`` with ``ProjectConfiguration(automatic_checkpoint_naming=True)`` has the same
gap: ``load_state()`` without a folder takes the highest ``checkpoints/checkpoint_N`` (Accelerate 1.10 to
1.16). There every process writes its ``random_states_<rank>.pkl`` last (rank 0's after the model,
optimizer, scheduler and samplers), then rank 0 the registered custom objects: a folder missing one of
them, or holding a torn one, was not finished. Whether a file is torn is read from its zip archive
(``torch.save``'s format: the central directory is written last, every member carries a CRC-32), never by
unpickling it: a checkpoint on a shared file system may hold a pickle someone planted to run code, and
Accelerate itself loads the RNG files with ``weights_only=True``, which refuses one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

from ... import logs

logger = logging.getLogger(__name__)

#: Written last by every Trainer release: its presence (and parsing) marks a finished checkpoint.
STATE_FILE = "trainer_state.json"


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
        picked, skipped = _newest_complete_of(folder, steps, incomplete)
        _warn(folder, skipped, picked)
        return picked

    return get_last_checkpoint


def _newest_complete_of(
    folder: str, numbered: list[tuple[int, str]], reason_of: Callable[[str], str | None]
) -> tuple[str | None, list[str]]:
    """The newest of ``numbered`` (number, name) folders that ``reason_of`` finds complete, and the skipped ones."""
    skipped = []
    for _, name in sorted(numbered, reverse=True):
        path = os.path.join(folder, name)
        reason = reason_of(path)
        if reason is None:
            return path, skipped
        skipped.append(f"{name} ({reason})")
    return None, skipped


def _warn(folder: str, skipped: list[str], picked: str | None) -> None:
    logs.once(
        logger,
        ("checkpoints.partial", folder, *skipped),
        "accelerate_neuron: in %s, skipped partial checkpoint(s) %s; %s. Delete the partial folder(s) once you "
        "no longer need them.",
        folder,
        ", ".join(skipped),
        f"resuming from {os.path.basename(picked)}" if picked else "no complete checkpoint is left to resume from",
    )


# --- Accelerate: load_state() with automatic checkpoint naming ------------------------------------

#: Upstream's own rule for a checkpoint's number: the last run of digits in its name.
_ACCELERATE_NUMBER = re.compile(r"([0-9]+)(?=[^/]*$)")


def accelerate_incomplete(path: str, processes: int, custom_objects: int) -> str | None:
    """Why the Accelerate ``save_state`` folder ``path`` is not finished, or None when it is (nothing unpickled)."""
    names = [f"random_states_{rank}.pkl" for rank in range(processes)]
    names += [f"custom_checkpoint_{index}.pkl" for index in range(custom_objects)]
    for name in names:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"no {name}: the save was interrupted"
        torn = torn_archive(file)
        if torn is not None:
            return f"{name} unreadable ({torn}): the save was interrupted"
    return None


def torn_archive(file: str) -> str | None:
    """Why the ``torch.save`` file ``file`` is not a whole archive, or None; reads its zip structure and CRCs only."""
    try:
        with zipfile.ZipFile(file) as archive:
            if not any(name.endswith("/data.pkl") for name in archive.namelist()):
                return "not a torch.save archive"
            bad = archive.testzip()  # every member's CRC-32 against its bytes
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if bad is None else f"member {bad} fails its CRC"


def wrap_accelerator_load_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state(self: Any, input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self, "project_configuration", None)
        if input_dir is None and getattr(config, "automatic_checkpoint_naming", False):
            input_dir = _newest_complete(self)
        return original(self, input_dir, *args, **kwargs)

    return load_state


def _newest_complete(accelerator: Any) -> str | None:
    """The folder ``load_state()`` should take, or None to leave the choice to upstream."""
    folder = os.path.join(accelerator.project_dir, "checkpoints")
    try:
        names = os.listdir(folder)
    except OSError:
        return None  # upstream raises its own error
    numbered = []
    for name in names:
        match = _ACCELERATE_NUMBER.search(name)
        if match is None or not os.path.isdir(os.path.join(folder, name)):
            return None  # a listing upstream's sort would not handle: its behaviour, not a guess
        numbered.append((int(match.group(1)), name))
    processes = accelerator.num_processes
    custom = len(getattr(accelerator, "_custom_objects", ()))
    picked, skipped = _newest_complete_of(folder, numbered, lambda path: accelerate_incomplete(path, processes, custom))
    if picked is not None:
        if skipped:
            _warn(folder, skipped, picked)
        return picked
    if skipped:
        # Nothing passes (e.g. each node's disk holds only its own ranks' files): upstream's choice, said.
        logs.once(
            logger,
            ("checkpoints.none_complete", folder, *skipped),
            "accelerate_neuron: in %s no checkpoint looks complete to this process (%s); load_state() "
            "takes the highest one as upstream does.",
            folder,
            ", ".join(skipped),
        )
    return None
