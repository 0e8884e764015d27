"""This process's remote tier: fetch on a local miss, publish in the background, and say once when it is down.

The local cache calls :meth:`Tier.fetch_into` on a miss, before compiling, and :meth:`Tier.publish` after
storing what it compiled. Fetching blocks (the job needs the entry now); publishing never does: a daemon thread
uploads, and at exit the process waits for it at most ``remote_cache_timeout`` seconds, then leaves what is not
published in the local cache (``accelerate-neuron cache push`` publishes it later).

Never a crash: a remote that cannot be reached, refuses a request or is misconfigured is reported once (naming
the URL, never a credential) and the job goes on compiling locally without it. An entry whose checksum does
not match is refused, reported, and replaced by the one this process compiles.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import logs, settings
from . import keys
from .remote import CorruptEntry, Remote, RemoteError
from .urls import RemoteURL, RemoteURLError

logger = logging.getLogger(__name__)

#: key, local file -> what the manifest records about the entry (what it is, who made it).
Summarize = Callable[[str, Path], dict[str, Any]]

_tiers: list[Tier] = []
_tiers_lock = threading.Lock()
_deadline: float | None = None


class Tier:
    """The remote cache at ``url`` for entries of ``kind`` (``simulated`` or ``neff``)."""

    def __init__(
        self,
        url: RemoteURL,
        *,
        kind: str,
        read_only: bool = False,
        timeout: float = 60.0,
        summarize: Summarize | None = None,
        remote: Remote | None = None,
    ) -> None:
        self.url = url
        self.kind = kind
        self.read_only = read_only
        self.timeout = timeout
        self.summarize = summarize
        self.remote = remote or Remote(url)
        self.down: str | None = None
        self.counts: Counter[str] = Counter()
        self._opened = False
        self._corrupt: set[str] = set()
        self._cond = threading.Condition()
        self._queue: list[tuple[str, Path]] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        with _tiers_lock:
            _tiers.append(self)

    # ---------------------------------------------------------------- state

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url.shown,
            "kind": self.kind,
            "read_only": self.read_only,
            "down": self.down,
            **{k: self.counts[k] for k in ("fetched", "refused", "published", "already_there", "not_published")},
        }

    def _usable(self) -> bool:
        if self.down is not None:
            return False
        if not self._opened:
            try:
                self.remote.fs  # noqa: B018 - opens the backend: a missing package fails here, once
                self.remote.check_root()
            except Exception as exc:
                self._go_down(exc)
                return False
            self._opened = True
        return True

    def _go_down(self, exc: BaseException) -> None:
        what = str(exc) if isinstance(exc, RemoteURLError | RemoteError) else f"{type(exc).__name__}: {exc}"
        self.down = what
        level = logging.ERROR if isinstance(exc, RemoteURLError) else logging.WARNING
        logs.once(
            logger,
            ("remote-cache-down", self.url.url),
            "accelerate_neuron: the remote compile cache %s cannot be used (%s). This job compiles locally and "
            "fetches and publishes nothing%s.",
            self.url.shown,
            what,
            "" if isinstance(exc, RemoteURLError) else "; `accelerate-neuron cache push` publishes its entries later",
            level=level,
        )

    def _namespace(self) -> str:
        return keys.fingerprint(keys.key_inputs(self.kind == "simulated"))

    # ---------------------------------------------------------------- fetch

    def fetch_into(self, key: str, dest: Path) -> bool:
        """Fetch ``key`` into ``dest`` if the remote has a valid entry; never raises."""
        if not self._usable():
            return False
        try:
            manifest = self.remote.fetch(self.kind, self._namespace(), key, dest)
        except CorruptEntry as exc:
            self.counts["refused"] += 1
            self._corrupt.add(key)
            logs.once(
                logger,
                ("remote-cache-corrupt", self.url.url, key),
                "accelerate_neuron: refused entry %s of the remote compile cache %s: %s. It is compiled here%s.",
                key,
                self.url.shown,
                exc,
                "" if self.read_only else " and published again",
            )
            return False
        except Exception as exc:
            self._go_down(exc)
            return False
        if manifest is None:
            self.counts["missed"] += 1
            return False
        self.counts["fetched"] += 1
        return True

    # ---------------------------------------------------------------- publish

    def publish(self, key: str, src: Path) -> None:
        """Queue ``src`` (the local entry of ``key``) for publishing; returns at once."""
        if self.read_only:
            return
        if self.down is not None:
            self.counts["not_published"] += 1
            return
        with self._cond:
            if self._pid != os.getpid():  # a forked child: its parent's thread is not here
                self._pid, self._thread, self._queue, self._busy = os.getpid(), None, [], False
            self._queue.append((key, src))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="accelerate-neuron-publish", daemon=True)
                self._thread.start()
                _register_exit()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                key, src = self._queue.pop(0)
                self._busy = True
            self._publish_one(key, src)

    def _publish_one(self, key: str, src: Path) -> None:
        if self.down is not None or not self._usable():
            self.counts["not_published"] += 1
            return
        try:
            meta = {"key_inputs": keys.key_inputs(self.kind == "simulated")}
            if self.summarize is not None:
                meta.update(self.summarize(key, src))
            meta.setdefault("made_by", {})["job"] = _job()
            fingerprint = keys.fingerprint(meta["key_inputs"])
            done = self.remote.publish(self.kind, fingerprint, key, src, meta, replace=key in self._corrupt)
        except FileNotFoundError:  # the local entry went away (pruned): nothing to publish
            self.counts["not_published"] += 1
            return
        except Exception as exc:
            self.counts["not_published"] += 1
            self._go_down(exc)
            return
        self.counts["published" if done else "already_there"] += 1

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + int(self._busy)

    def flush(self, timeout: float | None = None) -> int:
        """Wait for the queued publishes (at most ``timeout`` s, default this tier's); returns how many are left."""
        until = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while (self._queue or self._busy) and self._thread is not None and self._pid == os.getpid():
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            return len(self._queue) + int(self._busy)


def _job() -> str:
    """The job that made an entry: the script's name (the command line may hold secrets; never recorded)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    return os.path.basename(argv0) or "python"


def flush_all() -> None:
    """At exit: wait for every tier's publishes, at most ``remote_cache_timeout`` s in all; report what is left."""
    global _deadline
    with _tiers_lock:
        tiers = list(_tiers)
    for tier in tiers:
        if not tier.pending():
            continue
        if _deadline is None:
            _deadline = time.monotonic() + tier.timeout
        left = tier.flush(max(0.0, _deadline - time.monotonic()))
        if left:
            logs.once(
                logger,
                ("remote-cache-unpublished", tier.url.url),
                "accelerate_neuron: %d compile cache entr%s not published to %s within %g s at exit; they stay in "
                "the local cache (`accelerate-neuron cache push` publishes them; "
                "ACCELERATE_NEURON_REMOTE_CACHE_TIMEOUT allows longer)",
                left,
                "y was" if left == 1 else "ies were",
                tier.url.shown,
                tier.timeout,
            )


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    with _tiers_lock:
        if _exit_registered:
            return
        _exit_registered = True
    atexit.register(flush_all)


def from_settings(kind: str, summarize: Summarize | None = None) -> Tier | None:
    """The tier the ``remote_cache`` settings ask for, or None (unset, or a bad value: reported once)."""
    try:
        chosen = settings.get("remote_cache")
        read_only = settings.get("remote_cache_read_only")
        timeout = settings.get("remote_cache_timeout")
    except ValueError as exc:
        logs.once(
            logger,
            ("remote-cache-setting", str(exc)),
            "accelerate_neuron: %s; no remote compile cache is used",
            exc,
            level=logging.ERROR,
        )
        return None
    if chosen is None:
        return None
    return Tier(chosen, kind=kind, read_only=read_only, timeout=timeout, summarize=summarize)
