"""Experts whose shapes do not depend on routing (Transformers >= 5's experts interface).

Upstream's default, ``grouped_mm``, sorts the (token, expert) pairs by expert and
multiplies variable-size groups: on Neuron it counts tokens per expert with an
integer ``torch.histc`` (no lowering: a host round trip per layer) and its group
sizes change with every routing, so a compiled graph is either opaque to the
compiler (the ``offs.tolist()`` loop of its fallback) or recompiled. The two
implementations here take only ``num_tokens``, ``top_k`` and the weights' shapes:

- **dense**: every expert runs on every token (one batched matmul per projection over
  all experts), then each token's top-k outputs are gathered and weighted in upstream's
  order. Exact; ``num_experts / top_k`` times the experts' FLOPs of a sparse dispatch.
- **gathered** (upstream's ``batched_mm``): each (token, expert) pair gathers its
  expert's weights. Exact; the sparse FLOPs, but ``tokens x top_k`` copies of an
  expert's weights: cheaper than dense only while ``tokens x top_k < num_experts``
  (decode steps of small batches).

``auto`` takes, per call shape (so per compiled graph, never per routing), whichever
reads fewer expert weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import settings
from ...device import DEVICE_TYPE

#: The name this implementation is registered under in Transformers' ``ExpertsInterface``.
KEY = "neuron_static"
MODES = ("auto", "dense", "off")


def mode() -> str:
    """The ``moe_experts`` setting in force (``auto``, ``dense`` or ``off``)."""
    return settings.get("moe_experts")


def registered() -> bool:
    """Whether Transformers' experts interface knows :data:`KEY` (the registration patch applied)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return KEY in ALL_EXPERTS_FUNCTIONS


def choose(num_pairs: int, num_experts: int, chosen_mode: str) -> str:
    """``"dense"`` or ``"gathered"`` for a call routing ``num_pairs`` (token, expert) pairs."""
    if chosen_mode == "dense":
        return "dense"
    return "gathered" if num_pairs < num_experts else "dense"


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x`` (tokens, in) through every expert's ``weight`` -> (experts, tokens, out)."""
    # weight: (experts, out, in), or (experts, in, out) when transposed; one batched matmul either way.
    out = torch.matmul(x, weight if transposed else weight.transpose(-2, -1))
    if bias is not None:
        out = out + bias.unsqueeze(-2)
    return out


def dense_experts_forward(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """All experts on all tokens; each token keeps its top-k outputs, weighted and summed as upstream does."""
    num_experts = module.num_experts
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids = top_k_index
    sample_weights = top_k_weights
    if getattr(module, "_is_expert_parallel", False):
        # Expert parallelism marks pairs routed to another rank's experts with ids >= num_experts: their
        # weights are zero; clamping keeps the gather in bounds and the mask keeps them out of the gradient.
        foreign = expert_ids >= num_experts
        expert_ids = expert_ids.clamp(0, num_experts - 1)
        sample_weights = sample_weights.masked_fill(foreign, 0.0)
    has_bias = getattr(module, "has_bias", False)
    if module.has_gate:
        up = _project(
            hidden_states, module.gate_up_proj, module.gate_up_proj_bias if has_bias else None, module.is_transposed
        )
        # A model's own gate (_apply_gate) expects (pairs, 2 * intermediate): give it that layout.
        act = module._apply_gate(up.reshape(num_experts * num_tokens, -1))
    else:
        up = _project(hidden_states, module.up_proj, module.up_proj_bias if has_bias else None, module.is_transposed)
        act = module.act_fn(up.reshape(num_experts * num_tokens, -1))
    act = act.reshape(num_experts, num_tokens, -1)
    out = _project(act, module.down_proj, module.down_proj_bias if has_bias else None, module.is_transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out.reshape(num_experts * num_tokens, hidden_dim))
    out = out.reshape(num_experts, num_tokens, hidden_dim).transpose(0, 1)  # (tokens, experts, hidden)
    index = expert_ids.unsqueeze(-1).expand(num_tokens, expert_ids.size(-1), hidden_dim)
    picked = torch.gather(out, 1, index)  # (tokens, top_k, hidden): each token's own experts, in routing order
    weighted = picked * sample_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def static_experts_forward(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts interface entry: static shapes on Neuron, upstream's default anywhere else."""
    from transformers.integrations import moe

    chosen = mode()
    if hidden_states.device.type != DEVICE_TYPE or chosen == "off":
        # Off Neuron (a model still on the CPU, a CPU reference) this is exactly the default it replaced.
        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    if choose(top_k_index.numel(), module.num_experts, chosen) == "gathered":
        return moe.batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return dense_experts_forward(module, hidden_states, top_k_index, top_k_weights)
