"""Backfilled enum members: ``DistributedType.MULTI_NEURON`` and ``DynamoBackend.NEURON``.

Accelerate <= 1.12 has no ``MULTI_NEURON`` and <= 1.14 no ``DynamoBackend.NEURON``:
a config file naming them fails to load (``DistributedType("MULTI_NEURON")``
raises), and ``TorchDynamoPlugin(backend="neuron")`` refuses the backend.

An Enum class cannot gain a member through normal means. On Python 3.11 a
member is whatever the class's ``_member_map_`` / ``_value2member_map_`` /
``_member_names_`` say it is (attribute access falls back to
``EnumType.__getattr__`` -> ``_member_map_``), so each of these three class
attributes is replaced by a copy that also holds the new member. Replacing
(not mutating) keeps every change a revertible :class:`Patch`.

Both the ``launch`` and the ``training`` plugin need ``DynamoBackend.NEURON``:
each declares :func:`dynamo_backend_neuron`, and the shared patch keys make it
apply once, by whichever of the two is active.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from ..patching import Patch

_lock = threading.Lock()
# (module, class name, member name) -> the member object shared by the three patches
_members: dict[tuple[str, str, str], Any] = {}


def _member(cls: type[enum.Enum], module: str, name: str, value: str) -> Any:
    key = (module, cls.__name__, name)
    with _lock:
        member = _members.get(key)
        if member is None or type(member) is not cls:
            member = cls._member_type_.__new__(cls, value)  # type: ignore[attr-defined]
            member._name_ = name
            member._value_ = value
            member.__objclass__ = cls
            member._sort_order_ = len(cls._member_names_)
            _members[key] = member
        return member


def is_backfilled(member: Any) -> bool:
    """Whether ``member`` was added by this module (not defined upstream)."""
    return any(member is m for m in _members.values())


def has_native_member(cls: type[enum.Enum], name: str) -> bool:
    """Whether upstream itself defines ``cls.<name>`` (a backfilled member does not count)."""
    member = cls.__dict__.get("_member_map_", {}).get(name)
    return member is not None and not is_backfilled(member)


def member_patches(module: str, cls_name: str, name: str, value: str, reason: str, lacking: str) -> list[Patch]:
    """Three patches that add member ``name`` = ``value`` to enum ``module.cls_name``."""

    def owner() -> type[enum.Enum]:
        import importlib

        return getattr(importlib.import_module(module), cls_name)

    def add_to_map(original: dict) -> dict:
        return {**original, name: _member(owner(), module, name, value)}

    def add_to_values(original: dict) -> dict:
        return {**original, value: _member(owner(), module, name, value)}

    def add_to_names(original: list) -> list:
        return [*original, name]

    def needed_in(container_key: str) -> Any:
        def needed(original: Any) -> str | None:
            if container_key in original:
                return f"upstream {cls_name} already has {name}"
            return None

        return needed

    base = f"{module}.{cls_name}.{name}"
    return [
        Patch(
            module, f"{cls_name}._member_map_", add_to_map, reason, lacking, needed=needed_in(name), name=f"{base}#map"
        ),
        Patch(
            module,
            f"{cls_name}._value2member_map_",
            add_to_values,
            reason,
            lacking,
            needed=needed_in(value),
            name=f"{base}#values",
        ),
        Patch(
            module,
            f"{cls_name}._member_names_",
            add_to_names,
            reason,
            lacking,
            needed=needed_in(name),
            name=f"{base}#names",
        ),
    ]


_DATACLASSES = "accelerate.utils.dataclasses"


def distributed_type_multi_neuron() -> list[Patch]:
    return member_patches(
        _DATACLASSES,
        "DistributedType",
        "MULTI_NEURON",
        "MULTI_NEURON",
        "one process per Neuron core needs its own distributed type (config files, launch, DDP, reduce/gather)",
        "accelerate <= 1.12",
    )


def dynamo_backend_neuron() -> list[Patch]:
    return member_patches(
        _DATACLASSES,
        "DynamoBackend",
        "NEURON",
        "NEURON",
        "torch.compile(backend='neuron') through Accelerate's TorchDynamoPlugin / dynamo_config",
        "accelerate <= 1.14",
    )
