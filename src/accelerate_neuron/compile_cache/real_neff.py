"""On a Trainium host: publish at exit the NEFFs torch-neuronx compiled while this process ran.

torch-neuronx's compile path offers no documented hook, so on the real backend the remote tier cannot fetch
before a compile (``accelerate-neuron cache pull`` does that before the job). What its documented surface does
allow: its persistent cache is a folder of files (``TORCH_NEURONX_NEFF_CACHE_DIR``, default ``/tmp/neff_cache``,
``ab/cd/<key>.neff``, as indexed; verify on trn2). At exit, the NEFFs written there since this process started
are published to the remote (``neff/`` folder, under this host's key inputs), bounded by
``remote_cache_timeout``. Several ranks of a host may publish the same new file: the second finds it there.
"""

from __future__ import annotations

import atexit
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from . import tier as tiers
from .remote import KEY

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_DIR = "/tmp/neff_cache"
KIND = "neff"


def local_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV, "").strip() or DEFAULT_DIR)


def entries_since(root: Path, since: float) -> Iterator[tuple[str, Path]]:
    """``(key, path)`` of the regular ``ab/cd/<key>.neff`` files under ``root`` modified at or after ``since``."""
    try:
        shards = sorted(root.iterdir())
    except OSError:
        return
    for shard in shards:
        if len(shard.name) != 2 or shard.is_symlink() or not shard.is_dir():
            continue
        for sub in sorted(shard.iterdir()):
            if len(sub.name) != 2 or sub.is_symlink() or not sub.is_dir():
                continue
            for path in sorted(sub.iterdir()):
                key = path.name[: -len(".neff")] if path.name.endswith(".neff") else ""
                if not KEY.match(key):
                    continue
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size > 0 and st.st_mtime >= since:
                    yield key, path


def publish_since(tier: tiers.Tier, root: Path, since: float) -> int:
    """Queue every NEFF added under ``root`` since ``since`` for ``tier``, then wait for them (bounded)."""
    count = 0
    for key, path in entries_since(root, since):
        tier.publish(key, path)
        count += 1
    if count:
        tiers.flush_all()
    return count


def start() -> None:
    """On a real device with a writable remote cache: publish this process's new NEFFs at exit. Cheap: no I/O now."""
    tier = tiers.from_settings(KIND)
    if tier is None or tier.read_only:
        return
    since = time.time() - 1.0  # file systems round mtimes

    def _at_exit() -> None:
        try:
            publish_since(tier, local_root(), since)
        except Exception as exc:  # nothing may raise into the interpreter's shutdown
            logger.debug("accelerate_neuron: new NEFFs not published at exit: %s", exc)

    atexit.register(_at_exit)
