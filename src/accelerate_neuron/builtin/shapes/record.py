"""The sizes a job's calls see, recorded beside its compiled graphs, and the buckets fitted to them.

Every bucketed call notes the size it padded (a prompt's length, a batch's rows,
a training batch's length, a serving step's query and KV tokens) under the
setting that buckets it and the model's *record key* (its text config's hash:
the same model, the same traffic). At exit (and at the end of a ``precompile``
worker) the sizes are added to one JSON file per model in the NEFF cache folder,
``<TORCH_NEURONX_NEFF_CACHE_DIR>/accelerate-neuron-shapes/<key>.json`` (the
simulator's own cache folder on the simulated device), under a file lock,
written atomically.

A bucket setting set to ``fit`` takes its buckets from there
(:func:`fitted_buckets`), once per process and model: the set of at most as
many buckets as powers of two would use on the recorded sizes that computes the
fewest positions (:mod:`.fit`), then the setting's ``pow2`` buckets beyond the
largest size seen (a size never seen pads as it would have), once a set fitted to half the recorded sizes
computes fewer positions on the other half than the powers of two (:func:`.fit.held_out`: too few sizes fit
themselves, not the job). The set is saved in the record and reused,
identical on every rank and in every later run, so compiled graphs keep their
keys; a later run refits only when the sizes recorded since make a new set
compute at least :data:`REFIT_GAIN` fewer positions. A model with no recorded
sizes runs this process on ``pow2`` (and records its sizes for the next run).

Nothing is trusted that this process did not write: a record owned by another
user, in a folder another user can write, or corrupt, oversized or of another
format is ignored with one warning (the setting then runs on ``pow2``), and
never written to.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import stat
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ... import device, files, logs, settings
from . import fit as fitting
from .buckets import MAX_BUCKET, Buckets

logger = logging.getLogger(__name__)

FOLDER = "accelerate-neuron-shapes"
FORMAT = "accelerate-neuron shape record"
VERSION = 1
#: Settings whose every bucket a warm-up compiles, reached or not (a server's grid): their fitted sets count the
#: powers of two's bucket above the largest size seen against the graph budget.
WHOLE_GRID = frozenset({"serving_token_buckets", "serving_kv_buckets"})
#: A later run refits only when the new set computes this share fewer positions than the saved one.
REFIT_GAIN = 0.05
#: Bounds of a record we read: its size on disk, the distinct sizes per setting, one count.
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DISTINCT = 65536
MAX_COUNT = 2**53
#: The bucket settings whose sizes are recorded (and which ``fit`` applies to).
SETTINGS = (
    "prompt_buckets",
    "batch_buckets",
    "cache_buckets",
    "train_buckets",
    "serving_token_buckets",
    "serving_kv_buckets",
)
_REAL_NEFF_DEFAULT = "/tmp/neff_cache"
_SIMULATED_NEFF_FOLDER = "simulated-neff-cache"

_lock = threading.Lock()
_pending: dict[str, dict[str, Counter[int]]] = {}  # record key -> setting -> size -> count, not yet written
_frozen: dict[tuple[str, str], Buckets] = {}  # (record key, setting) -> the buckets this process uses
_exit_hook = False
_keys: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


class RecordError(ValueError):
    """A record this process cannot read (damaged, oversized, another format): replaced when it is written."""


class Untrusted(RecordError):
    """A record (or its folder) another user owns or can write: never read, never written."""


def record_key(model: Any) -> str | None:
    """The record a model's sizes go to: its text config's hash (None without a config)."""
    try:
        return _keys[model]
    except (KeyError, TypeError):
        pass
    key = _record_key(model)
    try:
        _keys[model] = key
    except TypeError:  # not weakly referenceable: computed each time
        pass
    return key


def _record_key(model: Any) -> str | None:
    config = getattr(model, "config", model)
    try:
        config = config.get_text_config(decoder=True)
    except Exception:
        pass
    try:
        text = config.to_json_string(use_diff=False)
    except Exception:
        return None
    kind = str(getattr(config, "model_type", "") or "model")
    return (
        f"{''.join(c for c in kind if c.isalnum() or c in '-_')[:32]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    )


def root() -> Path:
    """The folder records live in: beside the NEFF cache's compiled graphs."""
    chosen = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR", "").strip()
    if chosen:
        base = Path(chosen).expanduser()
    elif device.kind() == "simulated":
        base = settings.cache_dir() / _SIMULATED_NEFF_FOLDER
    else:
        base = Path(_REAL_NEFF_DEFAULT)
    return base / FOLDER


def note(key: str | None, setting: str, size: int, count: int = 1) -> None:
    """Record that a call of the model ``key`` padded ``size`` (``count`` rows of it) under ``setting``."""
    global _exit_hook
    if key is None or not 0 < size <= MAX_BUCKET or count <= 0:
        return
    with _lock:
        _pending.setdefault(key, {}).setdefault(setting, Counter())[int(size)] += int(count)
        if not _exit_hook:
            atexit.register(flush)
            _exit_hook = True


def pending() -> dict[str, dict[str, dict[int, int]]]:
    """The sizes noted in this process and not yet written (for tests and reports)."""
    with _lock:
        return {k: {s: dict(c) for s, c in v.items()} for k, v in _pending.items()}


def flush() -> None:
    """Add the sizes noted in this process to their records (never raises: it runs at exit)."""
    with _lock:
        taken = {k: {s: Counter(c) for s, c in v.items()} for k, v in _pending.items()}
        _pending.clear()
    for key, sizes in taken.items():
        try:
            _update(key, lambda record, sizes=sizes: _add_sizes(record, sizes))
        except Exception as exc:  # a record is an optimisation: losing one never breaks the job
            _warn_once("write", key, f"its sizes were not recorded ({exc})")


def reset() -> None:
    """Forget what this process noted and fitted (tests)."""
    with _lock:
        _pending.clear()
        _frozen.clear()


def fitted_buckets(key: str | None, setting: str, default: Callable[[], Buckets]) -> Buckets:
    """The ``fit`` buckets of ``setting`` for the model ``key``, the same for the whole process.

    ``default``: the setting's ``pow2`` buckets, used without recorded sizes and as the catch-all beyond them.
    """
    if key is None:
        return default()
    with _lock:
        frozen = _frozen.get((key, setting))
    if frozen is not None:
        return frozen
    chosen = _choose(key, setting, default())
    with _lock:
        return _frozen.setdefault((key, setting), chosen)


def _choose(key: str, setting: str, pow2: Buckets) -> Buckets:
    try:
        record = _read(_path(key), key)
    except RecordError as exc:
        _warn_once("read", key, f"{exc}; {settings.env_name(setting)}=fit runs on pow2")
        return pow2
    sizes = {s: c for s, c in record["sizes"].get(setting, {}).items() if s <= (pow2[-1] if pow2 else MAX_BUCKET)}
    if not sizes:
        logs.once(
            logger,
            ("shapes.fit_no_history", setting),
            "accelerate_neuron: %s=fit: no sizes recorded yet for this model, so this run uses pow2 and records the "
            "sizes it sees (%s); the next run (or accelerate-neuron precompile) fits buckets to them.",
            settings.env_name(setting),
            root(),
        )
        return pow2
    saved = record["fitted"].get(setting)
    whole_grid = setting in WHOLE_GRID
    if saved is None and pow2:
        # Not fitted yet: only once the sizes recorded predict the ones that follow (a set fitted to half of them
        # computes fewer positions than the powers of two on the other half).
        share = fitting.held_out(sizes, pow2, whole_grid)
        if share is None or share >= 1:
            logs.once(
                logger,
                ("shapes.fit_not_yet", key, setting),
                "accelerate_neuron: %s=fit: the %d sizes recorded for this model do not predict each other yet "
                "(%s), so this run stays on pow2 and records more; a later run fits once they do.",
                settings.env_name(setting),
                sum(sizes.values()),
                "one size"
                if share is None
                else f"buckets fitted to half of them compute {share:.2f}x the positions pow2 does on the other half",
            )
            return pow2
    # Beyond the largest size seen, the powers of two: a size never seen pads as it would have (each bucket is a
    # graph only once a call needs it).
    new = fitting.fitted(sizes, pow2, whole_grid)
    if saved is not None and fitting.cost(sizes, saved) * (1 - REFIT_GAIN) <= fitting.cost(sizes, new):
        return Buckets(saved, setting)
    try:
        _update(key, lambda rec: rec["fitted"].__setitem__(setting, list(new)))
    except Exception as exc:
        _warn_once("write", key, f"the fitted buckets were not saved ({exc})")
    logger.info(
        "accelerate_neuron: %s=fit: buckets %s fitted to %d recorded sizes of this model (powers of two: %s)",
        settings.env_name(setting),
        list(new),
        sum(sizes.values()),
        pow2.short(),
    )
    return Buckets(new, setting)


# ------------------------------------------------------------------ the file


def _path(key: str) -> Path:
    if not key or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-_" for c in key.lower()):
        raise RecordError(f"record key {key!r}")
    return root() / f"{key}.json"


def _check_owner(path: Path) -> None:
    """A file or folder this user owns and no other user can write; RecordError otherwise."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(f"{path} is a symbolic link")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise Untrusted(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{path} can be written by other users (mode {stat.filemode(info.st_mode)})")


def _empty(key: str) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "record": key, "sizes": {}, "fitted": {}}


def _read(path: Path, key: str) -> dict[str, Any]:
    """The record at ``path`` (an empty one if there is none), checked; RecordError when it cannot be trusted."""
    folder = path.parent
    if not folder.exists():
        return _empty(key)
    _check_owner(folder)
    if not path.exists():
        return _empty(key)
    _check_owner(path)
    if path.stat().st_size > MAX_FILE_BYTES:
        raise RecordError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path} is not readable JSON ({exc})") from None
    return _validated(raw, key, path)


def _validated(raw: Any, key: str, path: Path) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise RecordError(f"{path} is not a version-{VERSION} shape record")
    if raw.get("record") != key:
        raise RecordError(f"{path} holds the record of {raw.get('record')!r}, not {key!r}")
    sizes, fitted = raw.get("sizes"), raw.get("fitted")
    if not isinstance(sizes, dict) or not isinstance(fitted, dict):
        raise RecordError(f"{path} has no sizes/fitted tables")
    out = _empty(key)
    for setting, table in sizes.items():
        if setting not in SETTINGS or not isinstance(table, dict) or len(table) > MAX_DISTINCT:
            raise RecordError(f"{path}: sizes of {setting!r} are not a table of at most {MAX_DISTINCT} sizes")
        parsed: dict[int, int] = {}
        for size, count in table.items():
            if not (isinstance(size, str) and size.isdigit() and 0 < int(size) <= MAX_BUCKET):
                raise RecordError(f"{path}: size {size!r} of {setting} is not between 1 and {MAX_BUCKET}")
            if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_COUNT:
                raise RecordError(f"{path}: count {count!r} of {setting} size {size} is not between 1 and {MAX_COUNT}")
            parsed[int(size)] = count
        out["sizes"][setting] = parsed
    for setting, values in fitted.items():
        try:
            if setting not in SETTINGS or not isinstance(values, list) or not values:
                raise ValueError
            out["fitted"][setting] = tuple(Buckets(tuple(values), setting))
        except (ValueError, TypeError):
            raise RecordError(f"{path}: fitted buckets of {setting!r} are not ascending sizes") from None
    return out


def _update(key: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Read, change and write back the record of ``key`` under its lock (a corrupt record starts afresh)."""
    import filelock

    path = _path(key)
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owner(folder)
    with filelock.FileLock(str(path) + ".lock", timeout=60):
        try:
            record = _read(path, key)
        except Untrusted:
            raise
        except RecordError as exc:
            _warn_once("replace", key, f"{exc}: it is replaced by a fresh one")
            record = _empty(key)
        change(record)
        text = json.dumps(
            {
                **record,
                "sizes": {s: {str(k): v for k, v in sorted(t.items())} for s, t in record["sizes"].items()},
                "fitted": {s: list(v) for s, v in record["fitted"].items()},
            },
            indent=1,
        )
        files.write_atomically(path, text)
        os.chmod(path, 0o600)


def _add_sizes(record: dict[str, Any], sizes: Mapping[str, Counter[int]]) -> None:
    for setting, counts in sizes.items():
        table = record["sizes"].setdefault(setting, {})
        for size, count in counts.items():
            table[size] = min(MAX_COUNT, table.get(size, 0) + count)
        if len(table) > MAX_DISTINCT:  # keep the most frequent sizes: the file stays bounded
            kept = sorted(table.items(), key=lambda item: (-item[1], item[0]))[:MAX_DISTINCT]
            record["sizes"][setting] = dict(kept)


def _warn_once(what: str, key: str, detail: str) -> None:
    logs.once(logger, ("shapes.record", what, key), "accelerate_neuron: shape record of %s: %s", key, detail)
