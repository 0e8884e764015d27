"""Writing files: whole or not at all, with the permissions they would have had, never through a planted link.

A file is written beside its final name under an unpredictable temporary name (created with
``O_EXCL | O_NOFOLLOW``: a name someone planted first, or a symbolic link, fails instead of being
written through), then renamed over it in one step. The result keeps the mode the file had, or else
the mode a plain ``open(path, "w")`` would have given it (``0o666`` less the umask): a checkpoint file
written through here stays readable by whoever could read the one upstream writes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: ``O_NOFOLLOW`` where the platform has it (every POSIX system the plugin runs on).
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Folders the plugin creates for itself: nobody else may list, plant or replace anything in them.
PRIVATE_FOLDER = 0o700


def temporary_name(target: Path) -> Path:
    """An unpredictable name beside ``target`` (never ``<pid>.tmp``: another user could plant that one first)."""
    return target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"


def create_new(path: str | os.PathLike[str], mode: int = 0o666) -> int:
    """Create ``path`` for writing and return its descriptor; fails if anything (a link too) is there already.

    The kernel applies the umask to ``mode``, as it does for ``open(path, "w")``.
    """
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | _CLOEXEC, mode)


def make_folders(path: str | os.PathLike[str], mode: int = PRIVATE_FOLDER) -> Path:
    """Create ``path`` and any missing parent with ``mode`` (the umask may only narrow it); returns the path."""
    folder = Path(path)
    missing = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for level in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(level, mode)
    return folder


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | NOFOLLOW | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode_of_existing(target: Path) -> int | None:
    try:
        st = os.lstat(target)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


@contextlib.contextmanager
def replacing(
    path: str | os.PathLike[str], *, directory: bool = False, mode: int | None = None, durable: bool = True
) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    A file is renamed over an existing one (atomic on POSIX, also on NFS). Its mode is ``mode``, else
    the replaced file's, else what a plain ``open(path, "w")`` gives (``0o666`` less the umask).
    ``durable``: the file's data and the rename reach the disk before this returns (fsync), so a host
    that loses power right after never holds a name pointing at a short file.
    A folder (``directory=True``) is renamed only into an absent name, and if another process got there
    first, this one's copy is dropped and theirs kept.
    On failure the temporary path is removed and the exception goes on.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    keep = None
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    else:
        keep = mode if mode is not None else _mode_of_existing(target)
        tmp = temporary_name(target)
        os.close(create_new(tmp))
    try:
        yield tmp
        if directory:
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            if keep is not None:
                os.chmod(tmp, keep)
            if durable:
                _fsync_file(tmp)
            os.replace(tmp, target)
        if durable:
            fsync_folder(target.parent)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomically(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None, durable: bool = True
) -> Path:
    """Write ``data`` to ``path`` through :func:`replacing` (text as UTF-8)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path, mode=mode, durable=durable) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | NOFOLLOW | _CLOEXEC)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
    return Path(path)
