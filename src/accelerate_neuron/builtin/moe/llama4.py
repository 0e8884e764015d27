"""Llama 4's MoE layer on Neuron: the blockwise / gathered experts instead of every expert on every token.

``Llama4TextMoe`` (the same in Transformers 4.57 and >= 5, outside the experts interface) runs
every expert on every token: its router scores each token for every expert (the sigmoid of the
chosen experts' logits, 0 elsewhere), every expert gets every token scaled by its score, and the
outputs are summed over the experts. That is ``experts / top_k`` times the experts' FLOPs (16x
for Llama 4 Scout). An expert's input is scaled, not its output, so here each (token, expert)
pair is its own row, scaled by its score, through its expert only, summed per token in
ascending expert order (upstream's sum adds exact zeros for the other experts): upstream's
numbers at the FLOPs of a sparse dispatch. The router and the shared expert are upstream's.
``ACCELERATE_NEURON_MOE_EXPERTS=dense`` or ``off`` keeps upstream's layer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts, weights

MODULE = "transformers.models.llama4.modeling_llama4"


def sparse_forward(block: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_states = hidden_states.reshape(-1, block.hidden_dim)
    router_scores, router_logits = block.router(hidden_states)
    top_k = block.router.top_k
    # The router's own choice (the same top-k of the same logits), in ascending expert order.
    index = torch.topk(router_logits, top_k, dim=1).indices.sort(dim=1).values
    scores = router_scores.gather(1, index)
    num_tokens, hidden_dim = hidden_states.shape
    pairs_in = hidden_states.repeat_interleave(top_k, dim=0) * scores.reshape(-1, 1)
    stacked = weights.ExpertWeights(
        block.experts.num_experts,
        block.experts.gate_up_proj,
        block.experts.down_proj,
        block.experts.act_fn,
        is_transposed=True,
    )
    ones = scores.new_ones(num_tokens * top_k, 1)
    routed = experts.sparse_forward(stacked, pairs_in, index.reshape(-1, 1), ones, owner=block.experts)
    out = block.shared_expert(hidden_states)
    out.add_(routed.view(num_tokens, top_k, hidden_dim).sum(dim=1))
    return out, router_logits


def _runs_every_expert(original: Any) -> str | None:
    source = inspect.getsource(original)
    if "self.router(" in source and ".repeat(" in source and "self.experts(" in source:
        return None
    return "this release's Llama4TextMoe does not run every expert on every token"


def _wrap(original: Any) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> Any:
        if hidden_states.device.type != DEVICE_TYPE or experts.mode() in ("off", "dense"):
            return original(self, hidden_states)
        return sparse_forward(self, hidden_states)

    return forward


def patches(why: str) -> list[Patch]:
    return [
        Patch(
            MODULE,
            "Llama4TextMoe.forward",
            _wrap,
            reason=f"Llama4TextMoe on Neuron runs only each token's experts (blockwise, or gathered for small "
            f"decode steps) instead of every expert on every token: {why}",
            lacking="every release (every expert on every token: experts / top_k times the FLOPs)",
            params=("self", "hidden_states"),
            needed=_runs_every_expert,
        )
    ]
