"""The cost model now lives in :mod:`accelerate_neuron.costs` (the plugin side prices precompile's progress too)."""

from __future__ import annotations

from ..costs import SECONDS_PER_EAGER_SIGNATURE, SECONDS_PER_GRAPH, describe, describe_cache, estimate

__all__ = ["SECONDS_PER_EAGER_SIGNATURE", "SECONDS_PER_GRAPH", "describe", "describe_cache", "estimate"]
