"""Writing files so that a kill mid-write never leaves a torn one: write beside, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    A file is renamed over an existing one (atomic on POSIX, also on NFS); a
    folder (``directory=True``) is renamed only into an absent name, and if
    another process got there first, this one's copy is dropped and theirs kept.
    On failure the temporary path is removed and the exception goes on.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
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
            os.replace(tmp, target)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through :func:`replacing` (text as UTF-8)."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)
