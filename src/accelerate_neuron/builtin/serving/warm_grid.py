"""Which step shapes continuous batching's warm-up compiles: the ones a step can reach, announced, capped.

Each (query tokens, KV tokens) bucket of the grid is one compiled graph, a NEFF compile of minutes on
Trainium, and the default grid has 30. Most are out of reach of a given workload: a step reads at most the
past tokens of the requests it holds, so with ``R`` requests of at most ``P`` prompt tokens and ``N`` new
tokens each, no step reads more than ``R x (P + N)`` KV tokens, nor computes more than ``R x P`` query tokens
(and never more than the step's token budget). ``generate_batch`` knows ``R``, ``P`` and ``N`` (upstream's
workload hints, handed to the config resolution): the warm-up then compiles only the buckets those bounds
reach. A server (``init_continuous_batching``, ``transformers serve``) knows none of them: every cell of the
grid is reachable.

The ``serving_warmup_shapes`` setting chooses: ``auto`` (the reachable shapes), ``all`` (the whole grid),
or ``N`` (at most N of the reachable ones, smallest KV reads first, then fewest query tokens: the decode steps
of a few requests, which every workload has). A shape left out compiles when a step first needs it. The
shapes and their estimated compile time are logged before the warm-up starts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import costs, logs, settings

logger = logging.getLogger(__name__)

SETTING = "serving_warmup_shapes"
#: Where the bounds ride on a resolved ContinuousBatchingConfig (upstream deep-copies it: they go along).
REACH_ATTR = "_accelerate_neuron_serving_reach"


@dataclass(frozen=True)
class Reach:
    """The most query tokens and KV tokens a step of this workload can have (None: unbounded)."""

    query_tokens: int | None
    kv_tokens: int | None


def from_hints(hints: Any) -> Reach:
    """The bounds upstream's ``WorkloadHints`` give (requests, longest prompt, max_new_tokens)."""
    requests = getattr(hints, "num_requests", None)
    prompt = getattr(hints, "max_prompt_length", None)
    new = getattr(hints, "max_generated_length", None)
    if not isinstance(requests, int) or not isinstance(prompt, int) or requests <= 0 or prompt <= 0:
        return Reach(None, None)
    new = new if isinstance(new, int) and new > 0 else None
    return Reach(requests * prompt, requests * (prompt + new) if new is not None else None)


def note(cb_config: Any, hints: Any) -> None:
    """Record on a resolved config the bounds of the workload it was resolved for."""
    setattr(cb_config, REACH_ATTR, from_hints(hints))


def reach_of(cb_config: Any) -> Reach:
    """The bounds noted on a resolved config (unbounded: a server, or a config resolved without hints)."""
    reach = getattr(cb_config, REACH_ATTR, None)
    return reach if isinstance(reach, Reach) else Reach(None, None)


def choose(grid: Sequence[tuple[int, int]], reachable: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], str]:
    """The shapes to warm, smallest first, and why those (for the log): of the whole ``grid``, the ``reachable`` ones
    (the plan's grid within a :class:`Reach`), as the setting says."""
    mode = settings.get(SETTING)
    if mode == "all":
        return sorted(grid, key=lambda s: (s[1], s[0])), f"the whole grid ({settings.env_name(SETTING)}=all)"
    shapes = sorted(reachable, key=lambda s: (s[1], s[0]))
    why = (
        f"the {len(shapes)} a step of these requests can reach, of the {len(grid)} in the grid"
        if len(shapes) < len(grid)
        else "the whole grid (a server's requests are not known ahead)"
    )
    if isinstance(mode, int) and mode < len(shapes):
        return shapes[:mode], f"{mode} of {why}, capped by {settings.env_name(SETTING)}={mode}"
    return shapes, why


def announce(shapes: Sequence[tuple[int, int]], why: str, graphs_per_shape: int) -> None:
    """Say what the warm-up is about to compile, and what it costs on Trainium, before it starts."""
    if not shapes:
        logs.once(
            logger,
            ("serving.warmup_none", why),
            "accelerate_neuron: continuous batching warms no step shape (%s): each compiles when a step first "
            "needs it.",
            why,
        )
        return
    queries = sorted({q for q, _ in shapes})
    kvs = sorted({kv for _, kv in shapes})
    est = costs.estimate(len(shapes) * graphs_per_shape, 0)
    logs.once(
        logger,
        ("serving.warmup_plan", tuple(shapes)),
        "accelerate_neuron: continuous batching warms %d step shape(s) before serving, %s: query tokens %s x KV "
        "tokens %s; on Trainium about %.0f min of compiling on a cold NEFF cache (%s; loads from a warm one). "
        "%s=N caps it (the rest compile when first needed), =all warms the whole grid.",
        len(shapes),
        why,
        "/".join(map(str, queries)),
        "/".join(map(str, kvs)),
        est["seconds"] / 60,
        costs.describe(est),
        settings.env_name(SETTING),
    )
