"""The line every ``precompile_*.py`` script ends with: the simulator's compile counts and graph keys that
tests/test_precompile.py and tests/test_serving.py compare between a warm-up and the real run, plus the script's own
fields. Under ``torchrun`` / ``accelerate launch`` each rank prints one line, in turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from accelerate import PartialState

from accelerate_neuron import simulator


def print_report(missed: Callable[[dict[str, Any]], Any], **fields: Any) -> None:
    """Print one JSON line: the counts, the graph keys, ``missed(graph)`` for each graph the NEFF cache missed,
    and ``fields``."""
    st = simulator.stats()
    line = json.dumps(
        {
            "compiles": st["compiles"],
            "compile_cache_hits": st["compile_cache_hits"],
            "eager_compiles": st["eager_compiles"],
            "eager_cache_hits": st["eager_cache_hits"],
            "eager_signatures": st["eager_signature_list"],
            "graph_keys": sorted({g["cache_key"] for g in st["graphs"]}),
            "missed": [missed(g) for g in st["graphs"] if g["cache"] == "miss"],
            **fields,
        }
    )
    if not torch.distributed.is_initialized():
        print(line, flush=True)
        return
    # Ranks share the launcher's stdout, and a line longer than PIPE_BUF written by two processes at once can
    # interleave: each rank prints in turn.
    state = PartialState()
    for rank in range(state.num_processes):
        if rank == state.process_index:
            print(line, flush=True)
        state.wait_for_everyone()
