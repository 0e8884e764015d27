"""The simulated NEFF cache's remote tier: :mod:`accelerate_neuron.compile_cache.tier` for simulated entries.

Simulated entries are published under the remote's ``simulated/`` folder, marked ``"simulated": true``: a real
backend never looks there, so a record of the simulator is never served as a NEFF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..compile_cache import tier
from ..compile_cache.remote import read_local
from . import neff_cache

KIND = "simulated"
#: What of an entry's body the manifest repeats, so that `cache ls` reads no blob.
_SUMMARY = ("what", "kind", "signature", "inputs", "num_nodes", "made_by", "key_inputs")
#: A simulated entry is a small JSON record; a file larger than this is not one.
MAX_ENTRY_BYTES = 16 * 2**20


def summarize(key: str, path: Path) -> dict[str, Any]:
    """The manifest's description of the local entry at ``path``: what it is and who made it."""
    body = neff_cache.decode(key, read_local(path, MAX_ENTRY_BYTES))
    out = {name: body[name] for name in _SUMMARY if name in body}
    if "kind" in out:  # the manifest's "kind" is the entry's (simulated / neff); the graph's is its own field
        out["graph_kind"] = out.pop("kind")
    return out


def from_settings() -> tier.Tier | None:
    """The remote tier the settings ask for (``remote_cache``), or None."""
    return tier.from_settings(KIND, summarize)
