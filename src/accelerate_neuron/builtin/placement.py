"""Built-in plugin `placement` (placeholder until its issue lands)."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..patching import Patch


@hookimpl
def neuron_patches() -> list[Patch]:
    return []
