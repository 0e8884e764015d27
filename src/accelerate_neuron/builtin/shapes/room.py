"""Room for the bucketed graphs of one compiled frame: Dynamo's recompile limit raised to hold them.

A compiled function gets one graph per input shape; Dynamo's default limit (8
per frame) would run the shapes after the eighth eagerly, silently. Every
capability that compiles one function for several buckets (generate()'s
prefill and decode, a bucketed forward, a decoder layer compiled as a region,
a continuous-batching step) calls :func:`make_room_for_buckets` first.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Graphs one compiled frame may hold: prefill and decode graphs of every bucket a job touches.
GRAPH_ROOM = 256


def make_room_for_buckets(
    why: str = "generate() compiles one graph per prompt/batch/cache bucket", layers: int = 1
) -> None:
    """Raise Dynamo's recompile limits so the bucketed graphs of one frame never fall back to eager.

    ``layers``: how many modules share the frame (decoder layers compiled as regions: Dynamo keeps one entry per
    layer and shape, since each layer's index is a constant of its graph).
    """
    import torch._dynamo.config as dynamo_config

    room = max(GRAPH_ROOM, layers * 64)
    if dynamo_config.recompile_limit < room:
        logger.info(
            "accelerate_neuron: torch._dynamo.config.recompile_limit raised from %d to %d: %s in one frame",
            dynamo_config.recompile_limit,
            room,
            why,
        )
        dynamo_config.recompile_limit = room
    if getattr(dynamo_config, "accumulated_recompile_limit", room) < room:
        dynamo_config.accumulated_recompile_limit = room
