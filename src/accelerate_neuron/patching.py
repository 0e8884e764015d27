"""One small, reversible, idempotent mechanism for every patch the plugin makes.

A :class:`Patch` declares its target (``module`` + dotted ``attr``), why it
exists, which upstream releases lack the behaviour, and what the original
must look like (``params``). :func:`apply` replaces the target with
``wrap(original)`` and records it, or records why it skipped:

- the module or attribute is missing (renamed upstream);
- the original's signature no longer has the expected parameters;
- ``needed(original)`` says upstream already does it (feature detection, not
  version checks).

A skip is logged once at INFO with its reason and never raises into user
code. :func:`revert` / :func:`revert_all` restore the originals (tests).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import logs
from .records import as_dict

logger = logging.getLogger(__name__)

_MISSING = object()
MARKER = "__accelerate_neuron_patch__"


@dataclass(frozen=True)
class Patch:
    """A declared change to an upstream attribute.

    ``wrap(original)`` returns the replacement. ``aliases`` are other
    ``module.attr`` bindings of the same object (``from x import f`` copies);
    each is replaced only while it still is the original. ``needed(original)``
    returns ``None`` when the patch is needed, or the reason it is not.
    ``gone`` is the reason to report when the target does not exist because
    upstream replaced it with something that already does the job.
    """

    module: str
    attr: str
    wrap: Callable[[Any], Any]
    reason: str
    lacking: str = ""
    params: Sequence[str] = ()
    aliases: Sequence[str] = ()
    needed: Callable[[Any], str | None] | None = None
    name: str = ""
    gone: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def key(self) -> str:
        return self.name or self.target


@dataclass
class PatchRecord:
    """What happened to one patch: ``applied``, ``skipped`` or ``reverted``."""

    key: str
    target: str
    plugin: str
    reason: str
    lacking: str
    status: str
    detail: str = ""
    aliases: list[str] = field(default_factory=list)
    _undo: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return as_dict(self)


_lock = threading.RLock()
_records: dict[str, PatchRecord] = {}


def _resolve(module_name: str, attr: str) -> tuple[Any, str, Any]:
    """(owner, last attribute name, raw value) for ``module_name`` + dotted ``attr``."""
    module = sys.modules.get(module_name)
    if module is None:
        module = importlib.import_module(module_name)
    owner: Any = module
    parts = attr.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    name = parts[-1]
    if inspect.isclass(owner):
        raw = owner.__dict__.get(name, _MISSING)
        if raw is _MISSING:  # inherited: patch on the class that defines it
            raw = getattr(owner, name, _MISSING)
    else:
        raw = getattr(owner, name, _MISSING)
    return owner, name, raw


def _own(owner: Any, name: str) -> bool:
    """Whether ``name`` is ``owner``'s own attribute (a class may only inherit it)."""
    return not inspect.isclass(owner) or name in owner.__dict__


def _unwrap_descriptor(raw: Any) -> tuple[Any, Callable[[Any], Any]]:
    if isinstance(raw, staticmethod):
        return raw.__func__, staticmethod
    if isinstance(raw, classmethod):
        return raw.__func__, classmethod
    return raw, lambda f: f


def _signature_problem(func: Any, params: Sequence[str]) -> str | None:
    if not params:
        return None
    try:
        found = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return f"cannot read the signature of {func!r}"
    missing = [p for p in params if p not in found]
    if missing:
        return f"signature changed upstream: expected parameters {list(params)}, found {found}"
    return None


def apply(patch: Patch, plugin: str = "") -> PatchRecord:
    """Apply ``patch`` once; return its record (applied or skipped, with the reason)."""
    with _lock:
        existing = _records.get(patch.key)
        if existing is not None and existing.status == "applied":
            return existing
        record = PatchRecord(
            key=patch.key,
            target=patch.target,
            plugin=plugin,
            reason=patch.reason,
            lacking=patch.lacking,
            status="skipped",
        )
        _records[patch.key] = record
        try:
            owner, name, raw = _resolve(patch.module, patch.attr)
        except (ImportError, AttributeError) as exc:
            record.detail = f"target not found ({type(exc).__name__}: {exc})"
            _log_skip(record)
            return record
        if raw is _MISSING:
            record.detail = patch.gone or f"target not found: {patch.target} does not exist in this release"
            _log_skip(record)
            return record
        marker = getattr(raw, MARKER, None)
        # Another patch's wrapper (another key) is a target like any: this patch wraps it in turn.
        if marker is not None and getattr(marker, "key", patch.key) == patch.key:
            record.status, record.detail = "applied", "already patched"
            return record
        func, rewrap = _unwrap_descriptor(raw)
        problem = _signature_problem(func, patch.params)
        if problem is None and patch.needed is not None:
            try:
                problem = patch.needed(func)
            except Exception as exc:  # a broken probe means: leave upstream alone
                problem = f"feature probe failed ({type(exc).__name__}: {exc})"
        if problem is not None:
            record.detail = problem
            _log_skip(record)
            return record
        own = _own(owner, name)
        try:
            replacement = patch.wrap(func)
            try:
                setattr(replacement, MARKER, record)
                if callable(func) and not hasattr(replacement, "__wrapped__"):
                    replacement.__wrapped__ = func
            except (AttributeError, TypeError):
                pass  # e.g. a value patch on an immutable object
            setattr(owner, name, rewrap(replacement))
        except Exception as exc:
            record.detail = f"could not apply ({type(exc).__name__}: {exc})"
            _log_skip(record)
            return record
        # An attribute the class only inherited is removed again on revert, not pinned to the inherited value.
        record._undo.append((owner, name, raw if own else _MISSING))
        for alias in patch.aliases:
            _patch_alias(alias, func, rewrap(replacement), record)
        record.status = "applied"
        logger.debug("patched %s (%s)", patch.target, patch.reason)
        return record


def _patch_alias(alias: str, original: Any, replacement: Any, record: PatchRecord) -> None:
    module_name, _, attr = alias.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None:
        return
    current = getattr(module, attr, _MISSING)
    if current is original:
        setattr(module, attr, replacement)
        record._undo.append((module, attr, original))
        record.aliases.append(alias)
    elif current is replacement:
        # Imported after the patch (``from .x import f`` copied the replacement):
        # nothing to bind, but revert must restore the original here too.
        record._undo.append((module, attr, original))
        record.aliases.append(alias)


def patch_aliases_now(key: str, aliases: Sequence[str]) -> None:
    """Re-bind aliases in modules imported after ``key`` was applied."""
    with _lock:
        record = _records.get(key)
        if record is None or record.status != "applied" or not record._undo:
            return
        owner, name, original = record._undo[0]
        replacement = owner.__dict__.get(name) if inspect.isclass(owner) else getattr(owner, name)
        if original is _MISSING:  # inherited: the original is what the class resolved before the patch
            original = getattr(replacement, "__wrapped__", None)
        original_func, _ = _unwrap_descriptor(original)
        for alias in aliases:
            if alias not in record.aliases:
                _patch_alias(alias, original_func, replacement, record)


def _log_skip(record: PatchRecord) -> None:
    logs.once(
        logger,
        ("patching.skipped", record.key, record.detail),
        "accelerate_neuron: skipped patch %s: %s",
        record.target,
        record.detail,
        level=logging.INFO,
    )


def revert(key: str) -> bool:
    """Restore the original of patch ``key``; True if something was restored."""
    with _lock:
        record = _records.get(key)
        if record is None or record.status != "applied":
            return False
        for owner, name, original in reversed(record._undo):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        record._undo.clear()
        record.aliases.clear()
        record.status = "reverted"
        return True


def revert_all() -> int:
    """Restore every applied patch (newest first); returns how many were reverted."""
    with _lock:
        keys = [k for k, r in _records.items() if r.status == "applied"]
        return sum(revert(k) for k in reversed(keys))


def records() -> list[PatchRecord]:
    """All patch records of this process, in the order they were first attempted."""
    with _lock:
        return list(_records.values())


def forget() -> None:
    """Drop reverted and skipped records (tests)."""
    with _lock:
        for key in [k for k, r in _records.items() if r.status != "applied"]:
            del _records[key]
        logs.forget("patching.skipped")
