"""What the plugin reads from disk: only what the current user (or root) could have written.

Cache folders sit on shared hosts: ``~/.cache`` is the user's own, but ``ACCELERATE_NEURON_CACHE_DIR``
or ``TORCH_NEURONX_NEFF_CACHE_DIR`` may point anywhere. A folder or file owned by another user, or
writable by group or others, may hold what someone else planted there, so it is refused (with one
warning naming the path and its owner) unless ``ACCELERATE_NEURON_SHARED_CACHE_DIRS`` names the folder
as shared on purpose; even then no library is ever loaded from it. Files are opened with
``O_NOFOLLOW`` and ``O_NONBLOCK`` and checked on the open descriptor (what is checked is what is read):
a symbolic link, a FIFO, a device or an oversized file is refused, never followed, waited on or read whole.

Root's files are trusted as the user's own: root can change any of the user's files anyway.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from pathlib import Path

from . import files, logs, settings

logger = logging.getLogger(__name__)

SHARED_ENV = settings.env_name("shared_cache_dirs")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Untrusted(OSError):
    """A file or folder the plugin must not use: ``str()`` names the path and the reason."""


def user_name(uid: int) -> str:
    """``"alice (uid 1000)"``; ``"uid 1234"`` for a uid without a name."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def problem(st: os.stat_result, path: str | os.PathLike[str], *, shared: bool = False) -> str | None:
    """Why a file or folder with status ``st`` must not be trusted, or None.

    Owned by someone other than the current user (or root), or writable by group or others. In a folder
    shared on purpose (``shared``) both are expected and accepted.
    """
    if shared:
        return None
    if not _trusted_owner(st.st_uid):
        return f"{path} is owned by {user_name(st.st_uid)}, not by you, {user_name(os.geteuid())}"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"{path} is writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def shared_folders() -> tuple[Path, ...]:
    """The folders ``ACCELERATE_NEURON_SHARED_CACHE_DIRS`` names (a bad value: none, with a warning)."""
    try:
        return tuple(Path(p) for p in settings.get("shared_cache_dirs"))
    except ValueError as exc:
        logs.once(logger, ("trust.setting", str(exc)), "accelerate_neuron: %s; no folder is treated as shared", exc)
        return ()


def is_shared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is, or is inside, a folder shared between users on purpose."""
    here = Path(os.path.realpath(path))
    for folder in shared_folders():
        top = Path(os.path.realpath(folder))
        if here == top or top in here.parents:
            return True
    return False


def folder_mode(shared: bool) -> int:
    """Mode for a folder the plugin creates: private, or open to the user's group in a shared folder."""
    return 0o777 if shared else files.PRIVATE_FOLDER  # the umask then decides, as for the user's own mkdir


def check_folder(path: str | os.PathLike[str], *, create: bool = True, shared: bool | None = None) -> str | None:
    """Why the folder ``path`` must not be used (None: it may); creates it (0700) when missing and ``create``.

    ``shared`` defaults to whether ``ACCELERATE_NEURON_SHARED_CACHE_DIRS`` names it.
    """
    folder = Path(path)
    shared = is_shared(folder) if shared is None else shared
    try:
        if create:
            files.make_folders(folder, folder_mode(shared))
        st = os.stat(folder)  # a root the user set may be a link: its target is what is checked
    except FileNotFoundError:
        return None if not create else f"cannot create {folder}"
    except OSError as exc:
        return f"cannot use {folder} ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    return problem(st, folder, shared=shared)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | files.NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise Untrusted(exc.errno, f"{path} is a symbolic link") from None
        raise


def open_file(path: str | os.PathLike[str], *, limit: int, shared: bool = False) -> tuple[int, os.stat_result]:
    """Open the regular file ``path`` for reading, checked on its descriptor; the caller closes it.

    Raises :class:`Untrusted` for a symbolic link, anything but a regular file (a FIFO is never waited
    on), a file another user owns or may write (unless ``shared``), or one larger than ``limit`` bytes;
    ``FileNotFoundError`` when it is absent.
    """
    target = Path(path)
    fd = _open(target, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(errno.EINVAL, f"{target} is not a regular file")
        reason = problem(st, target, shared=shared)
        if reason:
            raise Untrusted(errno.EPERM, reason)
        if st.st_size > limit:
            raise Untrusted(errno.EFBIG, f"{target} is {st.st_size} bytes, more than the {limit} allowed")
        # Reads block again from here: O_NONBLOCK was only there so that opening a FIFO cannot hang.
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(path: str | os.PathLike[str], *, limit: int, shared: bool = False) -> bytes:
    """The bytes of the regular file ``path``, checked as :func:`open_file` does (at most ``limit``)."""
    fd, _ = open_file(path, limit=limit, shared=shared)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:  # it grew after the check
        raise Untrusted(errno.EFBIG, f"{path} is more than the {limit} bytes allowed")
    return data


def open_lock(path: str | os.PathLike[str]) -> int:
    """A descriptor of the lock file ``path`` (created 0600 if absent), never through a symbolic link.

    ``open(path, "w")`` would follow a link planted there and truncate its target.
    """
    target = Path(path)
    fd = _open(target, os.O_RDWR | os.O_CREAT)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(errno.EINVAL, f"{target} is not a regular file")
        reason = problem(st, target)
        if reason:
            raise Untrusted(errno.EPERM, reason)
    except BaseException:
        os.close(fd)
        raise
    return fd


def warn_refused(reason: str, consequence: str) -> None:
    """Say once that a path was refused, why (its owner or mode) and what the plugin does instead."""
    logs.once(
        logger,
        ("trust.refused", reason),
        "accelerate_neuron: %s: refused; %s. Use a folder of your own (mode 0700), or, if other users share it on "
        "purpose, name it in %s.",
        reason,
        consequence,
        SHARED_ENV,
    )
