"""The ``remote_cache`` URL: which fsspec backend opens it, and the package that backend needs.

Checked without importing anything heavy (the setting is parsed on ``import torch``): a URL with an
unknown scheme is refused here, a backend package that is not installed when the remote is opened.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

#: scheme -> (module fsspec imports for it, the pip package that provides it); None: fsspec itself.
BACKENDS: dict[str, tuple[str, str] | None] = {
    "file": None,
    "s3": ("s3fs", "s3fs"),
    "hf": ("huggingface_hub", "huggingface_hub"),
}
EXAMPLES = "file:///shared/neff-cache, s3://bucket/prefix or hf://datasets/org/repo"
_HF_KINDS = ("datasets", "models", "spaces")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")


class RemoteURLError(ValueError):
    """A ``remote_cache`` URL that cannot be used, with what is allowed."""


@dataclass(frozen=True, repr=False)
class RemoteURL:
    """A checked remote cache URL: ``scheme`` and the fsspec ``path`` of its root (no trailing slash).

    Printed (``str``, ``repr``, JSON reports) without any credentials the URL holds.
    """

    url: str
    scheme: str
    path: str

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"RemoteURL({self.shown!r})"

    @property
    def shown(self) -> str:
        """The URL as logs and reports print it: credentials someone put in it are never shown."""
        return redact(self.url)

    @property
    def local(self) -> bool:
        return self.scheme == "file"

    def missing_package(self) -> str | None:
        """The pip package this URL's backend needs and that is not installed, or None."""
        backend = BACKENDS[self.scheme]
        if backend is None:
            return None
        module, package = backend
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else package


def redact(url: str) -> str:
    """``s3://KEY:SECRET@bucket/x`` -> ``s3://***@bucket/x``: a URL may carry credentials, a log never does."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return url.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)


def parse(text: str) -> RemoteURL:
    """``text`` as a remote cache URL; :class:`RemoteURLError` naming it and what is allowed otherwise.

    A plain absolute path means ``file://`` (a folder shared over NFS/FSx).
    """
    raw = str(text).strip()
    shown = redact(raw)
    if raw.startswith("/"):
        raw = "file://" + raw
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    if scheme not in BACKENDS:
        what = f"scheme {parts.scheme + '://'!r}" if parts.scheme else "no scheme"
        raise RemoteURLError(
            f"remote cache URL {shown!r} has {what}: expected file://, s3:// or hf:// (e.g. {EXAMPLES})"
        )
    if parts.query or parts.fragment:
        raise RemoteURLError(f"remote cache URL {shown!r}: a query or fragment is not allowed (e.g. {EXAMPLES})")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RemoteURLError(
                f"remote cache URL {shown!r}: file:// takes an absolute path on this host (file:///mnt/fsx/neff), "
                f"not a host name ({parts.netloc!r}); mount the share and name its folder"
            )
        path = parts.path.rstrip("/")
        if not path.startswith("/") or path in ("", "/") or ".." in path.split("/"):
            raise RemoteURLError(
                f"remote cache URL {shown!r}: expected an absolute folder other than /, e.g. {EXAMPLES}"
            )
        return RemoteURL(raw, scheme, path)
    host = parts.netloc.rpartition("@")[2]
    segments = [s for s in parts.path.split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise RemoteURLError(f"remote cache URL {shown!r}: '.' and '..' are not allowed in the path")
    if scheme == "s3":
        if not _BUCKET.match(host):
            raise RemoteURLError(f"remote cache URL {shown!r}: expected s3://BUCKET[/PREFIX] with a valid bucket name")
        return RemoteURL(raw, scheme, "/".join([host, *segments]))
    # hf://[datasets|models|spaces/]org/repo[/path]: HfFileSystem's own paths (a model repo without a prefix).
    names = [host, *segments]
    repo = names[1:3] if names[0] in _HF_KINDS else names[:2]
    if not host or len(repo) < 2:
        raise RemoteURLError(
            f"remote cache URL {shown!r}: expected hf://datasets/ORG/REPO[/PATH] (or models/, spaces/, or "
            "hf://ORG/REPO for a model repo)"
        )
    return RemoteURL(raw, scheme, "/".join(names))
