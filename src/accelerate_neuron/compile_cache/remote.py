"""One remote compile cache, opened through fsspec: entries fetched and verified before use, published atomically.

Layout under the URL's root (the same on every backend)::

    <kind>/<fingerprint>/entries/<k0k1>/<key>.json   the manifest: checksum, size, key inputs, who made it
    blobs/<s0s1>/<sha256>                            the entry's bytes, named by their SHA-256

``kind`` is ``simulated`` (the simulator's records) or ``neff`` (torch-neuronx's NEFFs): a real backend never
looks under ``simulated``. ``fingerprint`` names the key inputs (:mod:`.keys`) the entry was compiled with.

Why a manifest and a content-addressed blob: a reader that finds a manifest finds a complete blob (the blob is
written first, and each object appears whole: an S3 PUT, a Hub commit, or a temp file renamed into place on a
shared folder); two hosts publishing one key at once each write their own blob and the last manifest wins, so
no reader ever pairs one host's manifest with the other's bytes. A crash between the two leaves an unreferenced
blob (``accelerate-neuron cache prune`` removes it), never a broken entry.

What is fetched is untrusted until checked: the manifest is bounded in size, names its key and kind, and its
blob's path is computed here from its checksum (never read from the manifest); the blob is streamed to a temp
file beside its destination, bounded by the manifest's size, and renamed into place only if its SHA-256 matches.
On a shared folder nothing is read through a symlink, only regular files are read, and a folder or file every
user may write is refused (anyone could plant an entry). A checksum proves integrity, not authorship: whoever may
write the remote may publish entries, so give consumers read access only (``remote_cache_read_only``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .urls import RemoteURL, RemoteURLError, parse

logger = logging.getLogger(__name__)

FORMAT = 1
KINDS = ("simulated", "neff")
#: A manifest is a few hundred bytes; more is not one of ours.
MANIFEST_MAX_BYTES = 64 * 1024
#: No entry is larger (a large model's NEFF is hundreds of MB); a manifest claiming more is refused.
MAX_ENTRY_BYTES = 16 * 2**30
CHUNK = 1 << 20
KEY = re.compile(r"^[A-Za-z0-9_-]{8,128}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
TEMP_PREFIX = ".tmp."


class RemoteError(OSError):
    """The remote cannot be used: unreachable, refused, or not writable."""


class CorruptEntry(ValueError):
    """A remote entry that is not what its manifest says (damaged, partial, or planted)."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY.match(key):
        raise ValueError(f"invalid compile cache key {key!r}: expected 8-128 letters, digits, '-' or '_'")
    return key


def open_filesystem(url: RemoteURL) -> Any:
    """The fsspec filesystem of ``url``; :class:`RemoteURLError` naming the URL and the package it needs."""
    missing = url.missing_package()
    if missing is not None:
        raise RemoteURLError(
            f"remote cache {url.shown}: the {url.scheme}:// scheme needs the {missing} package, which is not "
            f"installed: pip install {missing}"
        )
    try:
        import fsspec
    except ImportError:
        raise RemoteURLError(f"remote cache {url.shown} needs the fsspec package: pip install fsspec") from None
    options: dict[str, Any] = {}
    if url.scheme == "s3":
        # Credentials and endpoint come from the standard AWS chain (env, profile, instance role). A remote that is
        # down must cost seconds, not botocore's default retries with backoff on every lookup.
        options = {
            "use_listings_cache": False,
            "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
        }
    elif url.scheme == "hf":
        options = {"skip_instance_cache": True}
    try:
        return fsspec.filesystem(url.scheme, **options)
    except ImportError as exc:
        package = (url.missing_package() or getattr(exc, "name", None) or "its fsspec backend").replace("_", "-")
        raise RemoteURLError(
            f"remote cache {url.shown}: the {url.scheme}:// backend cannot be imported ({exc}): pip install {package}"
        ) from None


@dataclass(frozen=True)
class Listed:
    """An entry found by :meth:`Remote.entries`: its manifest, or why it is unreadable."""

    kind: str
    fingerprint: str
    key: str
    path: str
    manifest: dict[str, Any] | None
    error: str | None = None


class Remote:
    """A remote compile cache at ``url`` (a :class:`RemoteURL` or its text)."""

    def __init__(self, url: RemoteURL | str, filesystem: Any = None) -> None:
        self.url = url if isinstance(url, RemoteURL) else parse(url)
        self._fs = filesystem

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = open_filesystem(self.url)
        return self._fs

    @property
    def root(self) -> str:
        return self.url.path

    def __repr__(self) -> str:
        return f"Remote({self.url.shown!r})"

    # ---------------------------------------------------------------- paths (all computed here, never read)

    def manifest_path(self, kind: str, fingerprint: str, key: str) -> str:
        if kind not in KINDS or not FINGERPRINT.match(fingerprint):
            raise ValueError(f"invalid entry namespace {kind}/{fingerprint}")
        check_key(key)
        return f"{self.root}/{kind}/{fingerprint}/entries/{key[:2]}/{key}.json"

    def blob_path(self, sha256: str) -> str:
        if not SHA256.match(sha256):
            raise ValueError(f"invalid checksum {sha256!r}")
        return f"{self.root}/blobs/{sha256[:2]}/{sha256}"

    # ---------------------------------------------------------------- reading

    def check_root(self) -> None:
        """On a shared folder: refuse one every user may write. Elsewhere nothing to check without a request."""
        if not self.url.local:
            return
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise RemoteError(
                f"remote cache folder {self.root} does not exist (is the share mounted?); create it to start "
                "a cache (accelerate-neuron cache push creates it)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise RemoteError(f"remote cache {self.root} is not a folder")
        _refuse_world_writable(self.root, st)

    def _read_bounded(self, path: str, limit: int) -> bytes:
        """The bytes of ``path`` (FileNotFoundError if absent); :class:`CorruptEntry` beyond ``limit`` bytes."""
        if self.url.local:
            with _open_local(self.root, path) as fh:
                data = fh.read(limit + 1)
        else:
            data = self.fs.cat_file(path, start=0, end=limit + 1)
        if len(data) > limit:
            raise CorruptEntry(f"{path} is larger than {limit} bytes")
        return data

    def read_manifest(self, kind: str, fingerprint: str, key: str) -> dict[str, Any] | None:
        """The checked manifest of ``key``, None if there is none; :class:`CorruptEntry` if it is not valid."""
        path = self.manifest_path(kind, fingerprint, key)
        try:
            data = self._read_bounded(path, MANIFEST_MAX_BYTES)
        except FileNotFoundError:
            return None
        return check_manifest(data, kind=kind, key=key, source=path)

    def fetch(self, kind: str, fingerprint: str, key: str, dest: Path) -> dict[str, Any] | None:
        """Fetch ``key`` into the file ``dest`` (atomically, verified); its manifest, or None if absent.

        :class:`CorruptEntry` if the manifest or blob is bad (nothing is written then); other ``OSError`` if
        the remote cannot be read.
        """
        manifest = self.read_manifest(kind, fingerprint, key)
        if manifest is None:
            return None
        blob = self.blob_path(manifest["sha256"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=TEMP_PREFIX)
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out, contextlib.ExitStack() as stack:
                try:
                    fh = stack.enter_context(
                        _open_local(self.root, blob) if self.url.local else self.fs.open(blob, "rb")
                    )
                except FileNotFoundError:
                    raise CorruptEntry(f"its blob {blob} is missing (a partial publish)") from None
                while chunk := fh.read(min(CHUNK, manifest["size"] - size + 1)):
                    size += len(chunk)
                    if size > manifest["size"]:
                        raise CorruptEntry(f"{blob} is larger than the {manifest['size']} bytes its manifest says")
                    digest.update(chunk)
                    out.write(chunk)
            if size != manifest["size"]:
                raise CorruptEntry(f"{blob} has {size} bytes, its manifest says {manifest['size']} (truncated)")
            if digest.hexdigest() != manifest["sha256"]:
                raise CorruptEntry(f"{blob} does not match its SHA-256 (damaged or overwritten)")
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return manifest

    def entries(self, kind: str | None = None) -> Iterator[Listed]:
        """Every manifest under the root (or under ``kind``), read and checked (one request each)."""
        kinds = [kind] if kind else list(KINDS)
        for k in kinds:
            base = f"{self.root}/{k}"
            for path in sorted(self._find(base)):
                rel = path[len(base) + 1 :].split("/")
                if len(rel) != 4 or rel[1] != "entries" or not rel[3].endswith(".json"):
                    continue
                fingerprint, key = rel[0], rel[3][: -len(".json")]
                if not FINGERPRINT.match(fingerprint) or not KEY.match(key):
                    continue
                try:
                    manifest = check_manifest(
                        self._read_bounded(path, MANIFEST_MAX_BYTES), kind=k, key=key, source=path
                    )
                    yield Listed(k, fingerprint, key, path, manifest)
                except (CorruptEntry, OSError) as exc:
                    yield Listed(k, fingerprint, key, path, None, str(exc))

    def blobs(self) -> dict[str, dict[str, Any]]:
        """Every blob: checksum -> {"path", "size", "mtime"} (mtime None where the backend does not say)."""
        out = {}
        for path, info in self._find(f"{self.root}/blobs", detail=True).items():
            name = path.rsplit("/", 1)[-1]
            if SHA256.match(name):
                out[name] = {"path": path, "size": int(info.get("size") or 0), "mtime": _mtime(info)}
        return out

    def temporaries(self) -> list[tuple[str, float | None]]:
        """Temp files a publisher left behind on a shared folder (killed mid-write), with their age."""
        if not self.url.local:
            return []
        return [
            (p, _mtime(i))
            for p, i in self._find(self.root, detail=True).items()
            if p.rsplit("/", 1)[-1].startswith(TEMP_PREFIX)
        ]

    def _find(self, base: str, detail: bool = False) -> Any:
        if self.url.local:
            return _find_local(self.root, base, detail)
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(base)
        try:
            return self.fs.find(base, detail=detail)
        except FileNotFoundError:
            return {} if detail else []

    # ---------------------------------------------------------------- writing

    def publish(
        self,
        kind: str,
        fingerprint: str,
        key: str,
        src: Path,
        meta: dict[str, Any],
        *,
        replace: bool = False,
    ) -> bool:
        """Publish the local file ``src`` as ``key``; False if the remote already holds a valid entry for it.

        ``replace``: publish even over an existing manifest (one found corrupt).
        """
        path = self.manifest_path(kind, fingerprint, key)
        if not replace:
            try:
                if self.read_manifest(kind, fingerprint, key) is not None:
                    return False
            except CorruptEntry:
                pass  # a bad manifest is replaced by a good one
        if self.url.local:
            self.check_root()
        digest, size = _digest_file(src)
        blob = self.blob_path(digest)
        if not self._blob_complete(blob, size):
            self._put_file(src, blob)
        manifest = {
            "format": FORMAT,
            "key": key,
            "kind": kind,
            "simulated": kind == "simulated",
            "fingerprint": fingerprint,
            "sha256": digest,
            "size": size,
            "created": time.time(),
            "host": socket.gethostname(),
            **{k: v for k, v in meta.items() if k not in _RESERVED},
        }
        self._put_bytes(json.dumps(manifest, sort_keys=True, default=str).encode(), path)
        return True

    def delete(self, path: str) -> None:
        """Remove one object (a manifest, a blob or a temp file) under the root."""
        if not path.startswith(self.root + "/"):
            raise ValueError(f"{path} is not under {self.root}")
        if self.url.local:
            os.unlink(path)
        else:
            self.fs.rm_file(path)

    def _blob_complete(self, blob: str, size: int) -> bool:
        try:
            if self.url.local:
                st = os.lstat(blob)
                return stat.S_ISREG(st.st_mode) and st.st_size == size
            return int(self.fs.info(blob).get("size", -1)) == size
        except FileNotFoundError:
            return False

    def _put_file(self, src: Path, dest: str) -> None:
        if self.url.local:
            with _open_local_file(src) as fh:
                _write_local_atomically(self.root, dest, lambda out: _copy(fh, out))
        else:
            self.fs.put_file(str(src), dest)  # one object appears whole (S3 PUT / multipart complete, Hub commit)

    def _put_bytes(self, data: bytes, dest: str) -> None:
        if self.url.local:
            _write_local_atomically(self.root, dest, lambda out: out.write(data))
        else:
            self.fs.pipe_file(dest, data)


_RESERVED = frozenset({"format", "key", "kind", "simulated", "fingerprint", "sha256", "size"})


def check_manifest(data: bytes, *, kind: str, key: str, source: str) -> dict[str, Any]:
    """A manifest's JSON, checked field by field; :class:`CorruptEntry` naming what is wrong."""
    try:
        manifest = json.loads(data)
    except ValueError:
        raise CorruptEntry(f"{source} is not JSON (partial or damaged)") from None
    if not isinstance(manifest, dict):
        raise CorruptEntry(f"{source} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CorruptEntry(f"{source} has format {manifest.get('format')!r}, this version reads {FORMAT}")
    if manifest.get("key") != key or manifest.get("kind") != kind:
        raise CorruptEntry(f"{source} names {manifest.get('kind')!r} entry {manifest.get('key')!r}")
    if (kind == "simulated") is not (manifest.get("simulated") is True):
        raise CorruptEntry(f"{source}: 'simulated' does not match the folder it is in")
    size = manifest.get("size")
    if not isinstance(manifest.get("sha256"), str) or not SHA256.match(manifest["sha256"]):
        raise CorruptEntry(f"{source} has no valid sha256")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_ENTRY_BYTES:
        raise CorruptEntry(f"{source} has an invalid size {size!r} (at most {MAX_ENTRY_BYTES} bytes)")
    return manifest


# ------------------------------------------------------------------ shared folders: no symlinks, regular files only


def _refuse_world_writable(path: str, st: os.stat_result) -> None:
    if st.st_mode & stat.S_IWOTH:
        raise RemoteError(
            f"refusing the remote cache {path}: every user may write it (mode {stat.S_IMODE(st.st_mode):o}), so "
            "anyone could plant an entry; make it writable by the publishers only (chmod o-w)"
        )


def _check_components(root: str, path: str) -> None:
    """No folder between ``root`` and ``path`` is a symlink (the root itself is the user's choice)."""
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        raise CorruptEntry(f"{path} is outside {root}")
    current = root
    for part in rel.split(os.sep)[:-1]:
        current = os.path.join(current, part)
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise CorruptEntry(f"{current} is a symlink or not a folder: not followed")


@contextlib.contextmanager
def _open_local(root: str, path: str) -> Iterator[Any]:
    """Open a file under a shared folder: no symlink anywhere below the root, a regular file, not world-writable."""
    _check_components(root, path)
    with _open_local_file(Path(path)) as fh:
        _refuse_world_writable(path, os.fstat(fh.fileno()))
        yield fh


@contextlib.contextmanager
def _open_local_file(path: Path) -> Iterator[Any]:
    """Open ``path`` for reading without following a symlink or blocking on a FIFO; regular files only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink
            raise CorruptEntry(f"{path} is a symlink: not followed") from None
        raise
    fh = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptEntry(f"{path} is not a regular file")
        yield fh
    finally:
        fh.close()


def _write_local_atomically(root: str, dest: str, write: Callable[[Any], Any]) -> None:
    """Temp file (unpredictable name) beside ``dest``, written, flushed to disk, then renamed into place."""
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    _check_components(root, dest)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
            os.fchmod(out.fileno(), 0o644)  # the fleet's hosts (other users) read it
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _find_local(root: str, base: str, detail: bool) -> Any:
    """Files under ``base`` without following symlinks (``os.walk`` does not descend into symlinked folders)."""
    found: dict[str, dict[str, Any]] = {}
    for folder, _dirs, files in os.walk(base):
        for name in files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    found[path] = {"size": st.st_size, "mtime": st.st_mtime}
    return found if detail else list(found)


def _mtime(info: dict[str, Any]) -> float | None:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if isinstance(value, int | float):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
    return None


def _digest_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with _open_local_file(path) as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    if size > MAX_ENTRY_BYTES:
        raise ValueError(f"{path} is larger than {MAX_ENTRY_BYTES} bytes: not published")
    return digest.hexdigest(), size


def read_local(path: str | os.PathLike[str], limit: int) -> bytes:
    """A local regular file's bytes, read without following a symlink; :class:`CorruptEntry` beyond ``limit``."""
    with _open_local_file(Path(path)) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CorruptEntry(f"{path} is larger than {limit} bytes")
    return data


def _copy(src: Any, out: Any) -> None:
    while chunk := src.read(CHUNK):
        out.write(chunk)
