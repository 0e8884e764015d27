"""The simulated device's persistent compile cache, modelled on torch-neuronx's NEFF cache.

What the real backend does (its sources as indexed publicly, to verify on trn2): every
compiled graph and every eager op is a NEFF; before compiling, it looks in an in-memory
cache, then in a persistent one under ``TORCH_NEURONX_NEFF_CACHE_DIR`` (default
``/tmp/neff_cache``, sharded ``ab/cd/<key>.neff``, written by temp file + rename); on a
miss it takes a per-key file lock, looks again (another process may have compiled it
meanwhile) and compiles. ``TORCH_NEURONX_NEFF_DISABLE_CACHE=1`` turns the persistent
tier off. N ranks compiling one graph therefore pay 1 compile and N-1 loads.

The simulator does the same with the same names, except where it must not pretend:

- its default root is ``<ACCELERATE_NEURON_CACHE_DIR>/simulated-neff-cache`` (by default
  ``~/.cache/accelerate_neuron/...``), never ``/tmp/neff_cache``: on a Trainium host a venv
  without torch-neuronx starts the simulator, and its entries (which are not NEFFs) would
  then sit in the real cache, whose ``Clear()`` deletes every ``*.neff`` under its root.
  A directory named by ``TORCH_NEURONX_NEFF_CACHE_DIR`` is used only if it is empty or
  already carries the simulator's marker file; anything else may be a real NEFF cache, so
  the persistent tier stays off there (with a warning) and nothing is written into it;
- an entry holds no NEFF (nothing is compiled): it is a small JSON record of what was
  compiled (key, graph summary, versions) behind a SHA-256 checksum, so a damaged or
  truncated entry is detected, warned about and recompiled. The real backend, as indexed,
  only rejects empty files; what it does with a corrupt NEFF is unverified;
- lock files live under the root (``locks/``), where the real backend keeps them in
  ``TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR`` (local disk, because NFS locking is unreliable);
- it trusts only what the user could have written (:mod:`accelerate_neuron.trust`): a root, marker or
  entry owned by another user or writable by group/others is refused with a warning naming it and its
  owner (unless ``ACCELERATE_NEURON_SHARED_CACHE_DIRS`` names the folder as shared on purpose); an entry
  is read only if it is a regular file of at most :data:`MAX_ENTRY_BYTES`, never through a link; folders
  are created 0700 (in a shared folder, as the user's umask allows).

Nothing here imports torch: keys are computed by :mod:`.graph_key`; this module stores them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from .. import files, settings, trust

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DISABLE_ENV = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
LOCK_TIMEOUT_ENV = "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 1200.0
#: torch-neuronx's own default root: shown by ``accelerate-neuron env``, never written by the simulator.
REAL_DEFAULT_DIR = "/tmp/neff_cache"
SIMULATED_DIR_NAME = "simulated-neff-cache"
#: A root carrying this file belongs to the simulator.
MARKER = "ACCELERATE_NEURON_SIMULATED_NEFF_CACHE"
#: The plugin's shape records kept beside the compiled graphs (``builtin/shapes/record.py``): a root holding only
#: them is still empty of NEFFs, so the simulator may claim it.
SHAPE_RECORDS = "accelerate-neuron-shapes"
EXTENSION = ".neff"
MAGIC = b"accelerate-neuron simulated NEFF 1\n"
#: An entry is a small JSON record (a few hundred bytes): anything larger is refused unread.
MAX_ENTRY_BYTES = 1 << 20
_TRUE = ("1", "true", "yes")
_FALSE = ("", "0", "false", "no")

HIT = "hit"
MISS = "miss"


class DamagedEntry(ValueError):
    """An entry that is not a complete, checksummed record of its key."""


@dataclass(frozen=True)
class Lookup:
    """The outcome of one cache lookup: ``hit`` (nothing compiled) or ``miss`` (compiled)."""

    key: str
    status: str
    #: ``memory`` (this process compiled or loaded it already), ``disk``, or ``compiled``.
    source: str


def default_dir() -> Path:
    """The simulator's own root: beside its compiled library, per user, never torch-neuronx's."""
    return settings.cache_dir() / SIMULATED_DIR_NAME


def encode(key: str, body: Mapping[str, Any]) -> bytes:
    """An entry file: magic line, checksum line, JSON body naming its key."""
    payload = json.dumps({**body, "key": key}, sort_keys=True, default=str).encode()
    return MAGIC + f"sha256 {hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def decode(key: str, data: bytes) -> dict[str, Any]:
    """The body of an entry for ``key``; :class:`DamagedEntry` if it is not exactly that."""
    if not data.startswith(MAGIC):
        raise DamagedEntry("not a simulated NEFF entry (bad header)" if data else "empty file")
    head, sep, payload = data[len(MAGIC) :].partition(b"\n")
    if not sep or not head.startswith(b"sha256 "):
        raise DamagedEntry("truncated before its checksum")
    if hashlib.sha256(payload).hexdigest() != head[len(b"sha256 ") :].decode(errors="replace"):
        raise DamagedEntry("checksum mismatch (truncated or overwritten)")
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise DamagedEntry(f"unreadable body ({exc})") from None
    if body.get("key") != key:
        raise DamagedEntry(f"holds key {body.get('key')!r}, not {key!r}")
    return body


def disk_usage(root: str | os.PathLike[str]) -> tuple[int, int]:
    """(entries, bytes) of the ``*.neff`` files in a sharded cache root (real or simulated)."""
    entries = size = 0
    base = Path(root)
    try:
        shards = [d for d in base.iterdir() if d.is_dir() and len(d.name) == 2]
    except OSError:
        return 0, 0
    for shard in shards:
        for sub in shard.iterdir():
            if not sub.is_dir():
                continue
            for entry in sub.iterdir():
                if entry.name.endswith(EXTENSION):
                    with contextlib.suppress(OSError):
                        size += entry.stat().st_size
                        entries += 1
    return entries, size


class NeffCache:
    """One process's view of the compile cache: an in-memory tier and, with a root, a persistent one.

    ``contains`` answers "is this graph cached?" without compiling; ``get_or_compile`` and
    ``settle`` are safe from any number of processes sharing the root (what
    ``precompile --jobs N`` workers need).
    """

    def __init__(
        self,
        root: Path | None,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        off_reason: str | None = None,
        remote: Any = None,
    ):
        self.root = root
        #: The remote tier (:class:`accelerate_neuron.compile_cache.tier.Tier`) behind the persistent one, or None.
        self.remote = remote
        self.lock_timeout = lock_timeout
        self.off_reason = off_reason if root is None else None
        self._memory: set[str] = set()
        self._mutex = threading.Lock()
        self._claimed = False
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- what it is

    @property
    def persistent(self) -> bool:
        """Whether entries outlive this process (a root that the simulator may write)."""
        return self.root is not None and self._claim()

    def describe(self, usage: bool = False) -> dict[str, Any]:
        """Where the cache is and whether it is on; with ``usage``, its entries and bytes (walks the folder)."""
        if self.root is None:
            return {"enabled": False, "dir": None, "reason": self.off_reason}
        foreign = None if self._claimed else self._foreign()
        out: dict[str, Any] = {"enabled": not foreign, "dir": str(self.root), "reason": foreign}
        if usage:
            out["entries"], out["bytes"] = disk_usage(self.root) if not foreign else (0, 0)
        if self.remote is not None:
            out["remote"] = self.remote.describe()
        return out

    def entry_path(self, key: str) -> Path:
        """``root/ab/cd/<key>.neff``, torch-neuronx's two-level sharding."""
        if self.root is None:
            raise ValueError("this NEFF cache has no persistent tier (TORCH_NEURONX_NEFF_DISABLE_CACHE)")
        return self.root / key[:2] / key[2:4] / f"{key}{EXTENSION}"

    # ---------------------------------------------------------------- lookups

    def contains(self, key: str) -> bool:
        """Whether ``key`` is compiled already (in this process, or as a valid entry on disk)."""
        with self._mutex:
            if key in self._memory:
                return True
        return self.load(key) is not None

    def load(self, key: str) -> dict[str, Any] | None:
        """The verified entry of ``key``, or None; a damaged entry is warned about (once) and ignored."""
        if not self.persistent:
            return None
        path = self.entry_path(key)
        try:
            data = trust.read_file(path, limit=MAX_ENTRY_BYTES, shared=self.shared)
        except FileNotFoundError:
            return None
        except trust.Untrusted as exc:
            self._warn_once(
                "untrusted", "refused NEFF cache entry: %s; it is compiled again (said once per cache)", exc
            )
            return None
        except OSError as exc:
            self._warn_once(f"read:{key}", "cannot read NEFF cache entry %s (%s); it is compiled again", path, exc)
            return None
        try:
            return decode(key, data)
        except DamagedEntry as exc:
            self._warn_once(
                f"damaged:{key}",
                "damaged NEFF cache entry %s: %s. It is compiled again and rewritten; if this repeats, check the "
                "disk or delete the cache folder %s",
                path,
                exc,
                self.root,
            )
            return None

    def get_or_compile(self, key: str, compile: Callable[[], Mapping[str, Any]]) -> Lookup:
        """A hit if ``key`` is cached; else ``compile()`` (once across processes) and store its record."""
        with self._mutex:
            if key in self._memory:
                return Lookup(key, HIT, "memory")
        if self.load(key) is not None:
            self._remember(key)
            return Lookup(key, HIT, "disk")
        if not self.persistent:
            compile()
            self._remember(key)
            return Lookup(key, MISS, "compiled")
        try:
            with self._lock(f"{key}.lock"):
                if self.load(key) is not None:  # compiled by another process while this one waited
                    self._remember(key)
                    return Lookup(key, HIT, "disk")
                if self._fetch(key):
                    self._remember(key)
                    return Lookup(key, HIT, "remote")
                self._publish(key, self.store(key, compile()))
        except filelock.Timeout:
            self._warn_lock_timeout(key)
            self._publish(key, self.store(key, compile()))
        self._remember(key)
        return Lookup(key, MISS, "compiled")

    def settle(self, entries: Mapping[str, Callable[[], Mapping[str, Any]]]) -> dict[str, Lookup]:
        """:meth:`get_or_compile` for many small keys (eager ops) under one lock instead of one each."""
        results: dict[str, Lookup] = {}
        pending = []
        for key in entries:
            with self._mutex:
                cached = key in self._memory
            if cached:
                results[key] = Lookup(key, HIT, "memory")
            elif self.load(key) is not None:
                results[key] = Lookup(key, HIT, "disk")
            else:
                pending.append(key)
        if pending and self.persistent:
            try:
                with self._lock("batch.lock"):
                    for key in pending:
                        if self.load(key) is not None:
                            results[key] = Lookup(key, HIT, "disk")
                        elif self._fetch(key):
                            results[key] = Lookup(key, HIT, "remote")
                        else:
                            self._publish(key, self.store(key, entries[key]()))
                            results[key] = Lookup(key, MISS, "compiled")
            except filelock.Timeout:
                self._warn_lock_timeout("batch")
        for key in pending:
            if key not in results:
                entries[key]()
                results[key] = Lookup(key, MISS, "compiled")
        for key in results:
            self._remember(key)
        return results

    # ---------------------------------------------------------------- the remote tier (compile_cache.tier)

    def _fetch(self, key: str) -> bool:
        """On a local miss: fetch ``key`` from the remote tier into its entry file; True if it is now a valid entry."""
        if self.remote is None or not self.persistent:
            return False
        return self.remote.fetch_into(key, self.entry_path(key)) and self.load(key) is not None

    def _publish(self, key: str, stored: bool) -> None:
        """After a compile: hand the new entry to the remote tier, which publishes it in the background."""
        if self.remote is not None and stored:
            self.remote.publish(key, self.entry_path(key))

    # ---------------------------------------------------------------- storage

    def _remember(self, key: str) -> None:
        with self._mutex:
            self._memory.add(key)

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """The cross-process lock ``name``; raises ``filelock.Timeout`` after ``lock_timeout`` seconds."""
        assert self.root is not None
        try:
            files.make_folders(self.root / "locks", trust.folder_mode(self.shared))
            lock = filelock.FileLock(str(self.root / "locks" / name), timeout=self.lock_timeout)
            lock.acquire()
        except filelock.Timeout:
            raise
        except OSError as exc:  # a read-only or odd folder: compile anyway, without the lock
            self._warn_once(
                "lock",
                "cannot take the NEFF cache lock in %s (%s): compiling without it (processes sharing the cache "
                "may compile the same graph twice)",
                self.root,
                exc,
            )
            yield
            return
        try:
            yield
        finally:
            lock.release()

    def store(self, key: str, body: Mapping[str, Any]) -> bool:
        """Write an entry atomically (temp file in the same folder + rename); a failure only costs the entry.

        Safe without the lock: readers see the old entry or the new one, never a mix. Returns whether it was written.
        """
        if not self.persistent:
            return False
        path = self.entry_path(key)
        data = encode(key, {**body, "created": time.time(), "pid": os.getpid()})
        try:
            files.make_folders(path.parent, trust.folder_mode(self.shared))
            # The checksum catches a torn entry: no fsync per entry (eager ops store hundreds at exit).
            files.write_atomically(path, data, durable=False)
        except OSError as exc:
            self._warn_once(
                "store",
                "cannot write to the NEFF cache %s (%s): compiled graphs are not kept for the next run",
                self.root,
                exc,
            )
            return False
        return True

    @property
    def shared(self) -> bool:
        """Whether the root is shared between users on purpose (``ACCELERATE_NEURON_SHARED_CACHE_DIRS``)."""
        if self.root is None:
            return False
        known = self.__dict__.get("_shared")
        if known is None or known[0] != self.root:  # asked once per root, not per entry
            known = self.__dict__["_shared"] = (self.root, trust.is_shared(self.root))
        return known[1]

    def _foreign(self) -> str | None:
        """Why the root must not be used (another user's, or maybe a real NEFF cache), or None; creates nothing."""
        assert self.root is not None
        untrusted = trust.check_folder(self.root, create=False, shared=self.shared)
        if untrusted is not None:
            return untrusted
        marker = self.root / MARKER
        try:
            if os.path.lexists(marker):
                trust.read_file(marker, limit=4096, shared=self.shared)
                return None
            if not self.root.exists() or not any(entry.name != SHAPE_RECORDS for entry in self.root.iterdir()):
                return None
        except trust.Untrusted as exc:
            return f"its marker file is refused: {exc}"
        except OSError as exc:
            return f"cannot read {self.root} ({exc})"
        return (
            f"{self.root} is not empty and has no {MARKER} file: it may be a real torch-neuronx NEFF cache, "
            "which the simulator never writes into"
        )

    def _claim(self) -> bool:
        """Use the root only if it is the simulator's: empty, or carrying its marker file."""
        if self._claimed:
            return True
        assert self.root is not None
        reason = self._foreign()
        if reason is None:
            try:
                reason = trust.check_folder(self.root, shared=self.shared)  # creates it, 0700
                marker = self.root / MARKER
                if reason is None and not os.path.lexists(marker):
                    files.write_atomically(
                        marker,
                        "Compile-cache entries of accelerate-neuron's simulated Neuron device (not NEFFs).\n"
                        "Safe to delete; torch-neuronx does not read this folder unless pointed at it.\n",
                    )
            except OSError as exc:
                reason = f"cannot create {self.root} ({exc})"
        if reason is not None:
            self._warn_once(
                "claim",
                "the simulated NEFF cache is off: %s. Every graph counts as compiled. Point %s at an empty or "
                "simulator-owned folder of your own (one that other users share on purpose: name it in %s).",
                reason,
                CACHE_DIR_ENV,
                trust.SHARED_ENV,
            )
            self.off_reason, self.root = reason, None
            return False
        self._claimed = True
        return True

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("accelerate_neuron: " + message, *args)

    def _warn_lock_timeout(self, key: str) -> None:
        self._warn_once(
            "lock-timeout",
            "waited %g s for the NEFF cache lock of %s under %s (another process holds it); compiling without "
            "waiting longer. Raise %s if compiles legitimately take longer, or remove a stale lock.",
            self.lock_timeout,
            key,
            self.root,
            LOCK_TIMEOUT_ENV,
        )


# ------------------------------------------------------------------ this process's cache


def _disabled() -> tuple[bool, str | None]:
    """Whether ``TORCH_NEURONX_NEFF_DISABLE_CACHE`` turns the persistent tier off, and why a value is invalid."""
    raw = os.environ.get(DISABLE_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True, None
    if value in _FALSE:
        return False, None
    return False, (
        f"invalid {DISABLE_ENV}={raw!r}: expected 1/true/yes (cache off) or 0/false/no/unset (cache on); "
        "the NEFF cache stays on"
    )


def _lock_timeout() -> tuple[float, str | None]:
    """``TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT`` in seconds, and why a value is invalid."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT, None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0 < value < float("inf"):
        return value, None
    return DEFAULT_LOCK_TIMEOUT, (
        f"invalid {LOCK_TIMEOUT_ENV}={text!r}: expected a positive number of seconds, e.g. 1200; "
        f"using {DEFAULT_LOCK_TIMEOUT:g} s"
    )


def setting_errors() -> list[str]:
    """What is wrong with the NEFF cache variables (``accelerate-neuron env`` reports these)."""
    return [error for _, error in (_disabled(), _lock_timeout()) if error]


def from_environment(*, warn: bool = True) -> NeffCache:
    """The cache the environment asks for (the folder is created on first use, not here)."""
    if warn:
        for error in setting_errors():
            logger.warning("accelerate_neuron: %s", error)
    timeout, _ = _lock_timeout()
    disabled, _ = _disabled()
    if disabled:
        return NeffCache(None, lock_timeout=timeout, off_reason=f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV)}")
    from . import remote_tier

    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    root = Path(explicit).expanduser() if explicit else default_dir()
    return NeffCache(root, lock_timeout=timeout, remote=remote_tier.from_settings())


_current: NeffCache | None = None
_current_lock = threading.Lock()


def current() -> NeffCache:
    """This process's cache, read from the environment at first use (as torch-neuronx does)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = from_environment()
        return _current


def use(directory: str | os.PathLike[str] | None, remote: Any = None) -> NeffCache:
    """Make ``directory`` this process's cache from now on (None: memory only), with the remote tier ``remote``
    (a :class:`~accelerate_neuron.compile_cache.tier.Tier`, or None); returns the previous one."""
    global _current
    with _current_lock:
        previous = _current or from_environment()
        root = None if directory is None else Path(directory)
        _current = NeffCache(
            root, lock_timeout=_lock_timeout()[0], off_reason="use(None): no persistent tier", remote=remote
        )
        return previous


def restore(cache: NeffCache) -> None:
    """Put back a cache :func:`use` returned."""
    global _current
    with _current_lock:
        _current = cache


@contextlib.contextmanager
def temporary() -> Iterator[NeffCache]:
    """A cold cache in a fresh folder for the block (removed after): counts that do not depend on earlier runs."""
    folder = tempfile.mkdtemp(prefix="accelerate-neuron-neff-")
    previous = use(folder)
    try:
        yield current()
    finally:
        restore(previous)
        shutil.rmtree(folder, ignore_errors=True)
