"""Transformers 4.57's sparse MoE blocks (Qwen3-MoE, Mixtral): a dense loop over every expert on Neuron.

Those releases have no experts interface: each block's ``forward`` finds the experts
hit by the routing (``nonzero``) and runs each on the tokens routed to it, so the
number of expert calls and every expert's batch size change with the routing (new
eager signatures, or a new graph, per routing). On Neuron the replacement runs every
expert on every token and weights the outputs with the router's weights scattered to
a (tokens, experts) matrix, zero where a token was not routed. Sums are taken in
upstream's order (expert by expert, ascending), so results are upstream's.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts

#: (module, sparse MoE block class, the family's pretrained-model class) of the 4.57 blocks this replaces.
BLOCKS = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoePreTrainedModel"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "MixtralPreTrainedModel"),
)


def _loops_over_hit_experts(forward: Any) -> str | None:
    """None if ``forward`` is the routing-dependent loop this replaces, else why it is left alone."""
    source = inspect.getsource(forward)
    if "expert_hit" in source and "self.gate(" in source and "self.experts" in source:
        return None
    return "this release's block does not loop over the experts the routing hit (it has the experts interface)"


def dense_block_forward(block: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's routing, then every expert on every token, weighted by the (mostly zero) routing matrix."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    jitter = getattr(block, "jitter_noise", 0)
    if block.training and jitter > 0:  # Mixtral's router jitter, as upstream applies it
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    hidden_states = hidden_states.view(-1, hidden_dim)
    router_logits = block.gate(hidden_states)
    routing_weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):  # Mixtral always normalises; Qwen3-MoE when configured to
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    per_expert = torch.zeros(
        hidden_states.size(0), block.num_experts, dtype=hidden_states.dtype, device=hidden_states.device
    ).scatter(1, selected_experts, routing_weights)
    final_hidden_states = torch.zeros_like(hidden_states)
    for index, expert in enumerate(block.experts):
        final_hidden_states = final_hidden_states + expert(hidden_states) * per_expert[:, index, None]
    return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


def _wrap(original: Any) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> Any:
        if hidden_states.device.type != DEVICE_TYPE or experts.mode() == "off":
            return original(self, hidden_states)
        return dense_block_forward(self, hidden_states)

    return forward


def _compilable(_original: Any) -> property:
    # Read on instances only (in 4.57 by accelerate-neuron's generate() alone: static cache and compiled decode).
    return property(lambda _self: experts.mode() != "off")


def _block_loops(module: str, cls: str) -> Any:
    def needed(_original: Any) -> str | None:
        return _loops_over_hit_experts(getattr(importlib.import_module(module), cls).forward)

    return needed


def patches(why: str) -> list[Patch]:
    out = []
    for module, cls, pretrained in BLOCKS:
        out.append(
            Patch(
                module,
                f"{cls}.forward",
                _wrap,
                reason=f"{cls} on Neuron: {why}",
                lacking="Transformers < 5 (a Python loop over the experts the routing hit)",
                params=("self", "hidden_states"),
                needed=_loops_over_hit_experts,
            )
        )
        out.append(
            Patch(
                module,
                f"{pretrained}._can_compile_fullgraph",
                _compilable,
                reason=f"{pretrained}: its models compile whole once the sparse MoE block is dense (upstream says "
                "False because of the block's data-dependent torch.where), so generate() gets a static cache and "
                "a compiled decode step as dense models do",
                lacking="Transformers < 5",
                needed=_block_loops(module, cls),
            )
        )
    return out
