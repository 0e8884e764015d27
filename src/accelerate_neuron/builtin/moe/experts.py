"""Experts whose shapes do not depend on routing (Transformers >= 5's experts interface).

Upstream's default, ``grouped_mm``, sorts the (token, expert) pairs by expert and
multiplies variable-size groups: on Neuron it counts tokens per expert with an
integer ``torch.histc`` (no lowering: a host round trip per layer) and its group
sizes change with every routing, so a compiled graph is either opaque to the
compiler (the ``offs.tolist()`` loop of its fallback) or recompiled. The
implementations here take only ``num_tokens``, ``top_k`` and the weights' shapes:

- **blockwise** (:mod:`.blockwise`): the pairs sorted by expert into blocks of one expert
  each, a bound on the number of blocks that holds for every routing. Exact; about the
  FLOPs of a sparse dispatch (at most 1.5x with the block size chosen by shape).
- **gathered** (upstream's ``batched_mm``): each (token, expert) pair gathers its
  expert's weights. Exact; the sparse FLOPs, but ``tokens x top_k`` copies of an
  expert's weights: what decode steps of small batches run (``tokens x top_k < num_experts``).
- **dense**: every expert runs on every token (one batched matmul per projection over
  all experts), then each token's top-k outputs are gathered and weighted in upstream's
  order. Exact; ``num_experts / top_k`` times the experts' FLOPs of a sparse dispatch.

``auto`` takes, per call shape (so per compiled graph, never per routing), gathered for
calls routing fewer pairs than there are experts and blockwise otherwise. Every call
notes what it computed in :mod:`accelerate_neuron.moe_accounting`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import moe_accounting, settings
from ...device import DEVICE_TYPE
from . import blockwise

#: The name this implementation is registered under in Transformers' ``ExpertsInterface``.
KEY = "neuron_static"
MODES = ("auto", "blockwise", "dense", "off")


def mode() -> str:
    """The ``moe_experts`` setting in force (``auto``, ``blockwise``, ``dense`` or ``off``)."""
    return settings.get("moe_experts")


def registered() -> bool:
    """Whether Transformers' experts interface knows :data:`KEY` (the registration patch applied)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return KEY in ALL_EXPERTS_FUNCTIONS


def choose(num_pairs: int, num_experts: int, chosen_mode: str) -> str:
    """``"gathered"``, ``"blockwise"`` or ``"dense"`` for a call routing ``num_pairs`` (token, expert) pairs."""
    if chosen_mode in ("dense", "blockwise"):
        return chosen_mode
    return "gathered" if num_pairs < num_experts else "blockwise"


def block_plan(num_tokens: int, top_k: int, num_experts: int, routed_experts: int | None = None) -> blockwise.Plan:
    """The blockwise layout of a call, with the ``moe_block_size`` / ``moe_capacity_factor`` settings in force."""
    return blockwise.plan(
        num_tokens,
        top_k,
        num_experts,
        block=settings.get("moe_block_size"),
        capacity_factor=settings.get("moe_capacity_factor"),
        routed_experts=routed_experts,
    )


#: Config attributes naming a model's number of routed experts (families name it differently).
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def routed_experts(module: Any) -> int | None:
    """Under expert parallelism, the experts of every rank (the model's config); else None (this module's)."""
    if not getattr(module, "_is_expert_parallel", False):
        return None
    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _EXPERT_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def row_flops(module: Any) -> int:
    """FLOPs of one row through one expert: 2 x its up (or gate/up) and down projections' weights."""
    first = module.gate_up_proj if module.has_gate else module.up_proj
    return 2 * (math.prod(first.shape[1:]) + math.prod(module.down_proj.shape[1:]))


def note(implementation: str, tokens: Any, top_k: Any, experts: Any, rows: Any, flops: Any) -> None:
    """Count the call in :mod:`accelerate_neuron.moe_accounting` (shapes a compile left symbolic are not counted)."""
    if all(isinstance(v, int) for v in (tokens, top_k, experts, rows, flops)):
        moe_accounting.note_call(implementation, tokens, top_k, experts, rows, flops)


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


def blockwise_experts_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    spec: blockwise.Plan | None = None,
    owner: Any = None,
) -> torch.Tensor:
    """The pairs sorted into blocks of one expert each (:mod:`.blockwise`), noted in ``moe_accounting``.

    ``spec`` defaults to the settings' plan for the call; ``owner`` (default ``module``) keeps the drops of a
    capacity-mode call.
    """
    num_tokens, top_k = top_k_index.shape
    spec = spec if spec is not None else block_plan(num_tokens, top_k, module.num_experts, routed_experts(module))
    out, placed = blockwise.experts_forward(module, hidden_states, top_k_index, top_k_weights, spec)
    kind = "gathered" if spec.block == 1 else "blockwise" if spec.capacity is None else "blockwise_capacity"
    note(kind, num_tokens, top_k, module.num_experts, spec.rows, row_flops(module))
    if placed.dropped is not None:
        setattr(owner if owner is not None else module, moe_accounting.DROPPED_ATTR, placed.dropped)
    return out


def sparse_forward(
    weights: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, owner: Any
) -> torch.Tensor:
    """Experts in another layout (:mod:`.weights`), on Neuron: as the interface's, chosen by the call's shape.

    The gathered path is blockwise with blocks of one row (no padding: each pair reads its expert's weights).
    """
    num_tokens, top_k = top_k_index.shape
    how = choose(top_k_index.numel(), weights.num_experts, mode())
    if how == "dense":
        out = dense_experts_forward(weights, hidden_states, top_k_index, top_k_weights)
        note("dense", num_tokens, top_k, weights.num_experts, num_tokens * weights.num_experts, row_flops(weights))
        return out
    spec = blockwise.plan(num_tokens, top_k, weights.num_experts, block=1) if how == "gathered" else None
    return blockwise_experts_forward(weights, hidden_states, top_k_index, top_k_weights, spec, owner=owner)


def in_expert_order(top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's pairs by ascending expert id: the order a loop over the experts adds their outputs in."""
    index, order = top_k_index.sort(dim=-1, stable=True)
    return index, top_k_weights.gather(-1, order)


def static_experts_forward(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts interface entry: static shapes on Neuron, upstream's default anywhere else."""
    from transformers.integrations import moe

    chosen = mode()
    if hidden_states.device.type != DEVICE_TYPE or chosen == "off":
        # Off Neuron (a model still on the CPU, a CPU reference) this is exactly the default it replaced.
        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    num_tokens, top_k = top_k_index.shape
    how = choose(top_k_index.numel(), module.num_experts, chosen)
    if how == "blockwise":
        return blockwise_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    if how == "gathered":
        rows = num_tokens * top_k
        out = moe.batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    else:
        rows = num_tokens * module.num_experts
        out = dense_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    note(how, num_tokens, top_k, module.num_experts, rows, row_flops(module))
    return out
