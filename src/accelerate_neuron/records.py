"""Plain-data views of the package's records (``status()``, patches, plugins) for JSON and tests."""

from __future__ import annotations

import dataclasses
from typing import Any


def as_dict(record: Any, *properties: str) -> dict[str, Any]:
    """The public fields of dataclass ``record`` (names without a leading ``_``), then the named properties."""
    out = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if not f.name.startswith("_")}
    out.update({name: getattr(record, name) for name in properties})
    return out
