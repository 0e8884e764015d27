"""Blockwise experts: the sparse work of a mixture-of-experts layer, with shapes fixed by the call's shape.

The (token, expert) pairs of a call are sorted by expert (a stable sort: token order within an
expert) and packed into blocks of ``B`` rows, each block holding pairs of one expert only; the
rows an expert's last block does not fill point at a zero row. Each block is multiplied by its
expert's weights, and every pair reads its row back, weighted, summed over its top-k slots in
upstream's order. No op depends on the routing for its shape (no ``histc``, ``nonzero`` or
``.tolist()``): the number of blocks is the bound that holds for every routing,

    blocks = ceil((pairs + experts * (B - 1)) / B)  <=  ceil(pairs / B) + experts,

since each expert wastes at most ``B - 1`` rows of its last block. **Dropless**: every pair has
its row, so the output is upstream's for every routing. The experts' FLOPs are
``blocks * B / pairs`` times those of a sparse dispatch (:func:`choose_block` keeps that at most
1.5 by default), against ``experts / top_k`` for dense experts.

With a capacity factor ``Cf`` (only when asked: ``moe_capacity_factor``), each expert gets
``C = min(tokens, ceil(tokens * top_k * Cf / experts))`` rows, as NeuronX Distributed's
``capacity_factor``: the pairs past an expert's capacity (the later tokens) are dropped,
counted in :mod:`accelerate_neuron.moe_accounting`; no weight is gathered, ``experts * C`` rows run.

Weights are read per block: a block's expert's weights are gathered for its matmul, in groups of
at most ``experts`` blocks so the transient copy never exceeds the layer's own weights, and
:class:`_BlockLinear` saves only its inputs for backward, never the gathered copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: Largest block chosen by shape (NeuronX Distributed's default block size).
MAX_BLOCK = 512


@dataclass(frozen=True)
class Plan:
    """The static numbers of one call shape (they never depend on the routing)."""

    tokens: int
    top_k: int
    experts: int
    block: int  # rows per block (the capacity per expert in capacity mode)
    blocks: int
    capacity: int | None = None  # rows per expert when a capacity factor is in force

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def rows(self) -> int:
        return self.blocks * self.block

    @property
    def flops_ratio(self) -> float:
        """The experts' FLOPs over a sparse dispatch's (rows computed per pair routed)."""
        return self.rows / max(1, self.pairs)


def choose_block(pairs: int, experts: int) -> int:
    """The block size for ``pairs`` routed over ``experts``: the largest power of two (at most
    :data:`MAX_BLOCK`) whose worst-case padding, ``experts * (B - 1)`` rows, is at most half the pairs.

    Larger blocks make larger matmuls (the tensor engine's tiles fill) and fewer weight reads per pair;
    smaller blocks pad less. Half the pairs bounds the experts' FLOPs at 1.5x a sparse dispatch.
    """
    limit = pairs // (2 * experts) + 1
    block = 1
    while block * 2 <= min(limit, MAX_BLOCK):
        block *= 2
    return block


def plan(
    tokens: int,
    top_k: int,
    experts: int,
    block: int | None = None,
    capacity_factor: float | None = None,
    routed_experts: int | None = None,
) -> Plan:
    """The blockwise layout of a call of ``tokens`` tokens routed to ``top_k`` of ``experts`` experts.

    ``routed_experts``: how many experts the pairs are spread over, when more than these (expert parallelism: the
    group's pairs over every rank's experts); a capacity is the share of one of them.
    """
    pairs = tokens * top_k
    if capacity_factor is not None:
        spread = routed_experts if routed_experts is not None else experts
        capacity = max(1, min(tokens, math.ceil(pairs * capacity_factor / spread)))
        return Plan(tokens, top_k, experts, block=capacity, blocks=experts, capacity=capacity)
    size = block if block is not None else choose_block(pairs, experts)
    blocks = -(-(pairs + experts * (size - 1)) // size)
    return Plan(tokens, top_k, experts, block=size, blocks=blocks)


@dataclass
class Layout:
    """Where each pair goes, for one call (tensors on the call's device, shapes from :class:`Plan`)."""

    row_token: torch.Tensor  # (rows,): the token each row reads; ``tokens`` (the zero row) for padding
    block_expert: torch.Tensor | None  # (blocks,): each block's expert; None when block b is expert b
    pair_row: torch.Tensor  # (pairs,): the row holding each pair's output; ``rows`` (a zero row) if it has none
    dropped: torch.Tensor | None  # pairs past capacity (capacity mode), a 0-d count


def layout(expert_ids: torch.Tensor, valid: torch.Tensor | None, spec: Plan) -> Layout:
    """Sort the pairs by expert and give each a row, with static-shape ops only.

    ``expert_ids`` (pairs,) are in ``[0, experts)`` where ``valid`` (or everywhere, if None); the others (an
    expert-parallel sentinel) get no row.
    """
    device = expert_ids.device
    pairs, experts, block, rows = spec.pairs, spec.experts, spec.block, spec.rows
    # Pairs without an expert sort past the last one (key ``experts``).
    key = expert_ids if valid is None else torch.where(valid, expert_ids, experts)
    order = torch.argsort(key, stable=True)
    sorted_key = key.gather(0, order)
    counts = torch.zeros(experts + 1, dtype=key.dtype, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:experts]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in the sorted order
    position = torch.arange(pairs, device=device)
    expert = sorted_key.clamp(max=experts - 1)
    rank = position - first.gather(0, expert)  # a pair's place among its expert's pairs (token order)
    kept = sorted_key < experts
    dropped = None
    if spec.capacity is not None:
        row_first = torch.arange(experts, device=device) * block
        block_expert = None
        over = kept & (rank >= block)
        dropped = over.sum()
        kept = kept & (rank < block)
    else:
        blocks_per_expert = (counts + (block - 1)) // block
        block_end = torch.cumsum(blocks_per_expert, 0)
        row_first = (block_end - blocks_per_expert) * block
        # Block b belongs to the expert whose blocks end first after b; blocks past the last expert's (unused
        # worst-case room, padding rows only) are given the last expert, whose weights they read for nothing.
        block_index = torch.arange(spec.blocks, device=device)
        block_expert = (block_index.unsqueeze(1) >= block_end.unsqueeze(0)).sum(1).clamp(max=experts - 1)
    row_sorted = torch.where(kept, row_first.gather(0, expert) + rank, rows)
    pair_row = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)
    # Rows to tokens: a pair without a row writes a slot of its own past the rows (then cut off), so every
    # scatter index is distinct and the result deterministic.
    slot = torch.where(kept, row_sorted, rows + position)
    row_token = torch.full((rows + pairs,), spec.tokens, dtype=order.dtype, device=device)
    row_token = row_token.scatter_(0, slot, order // spec.top_k)[:rows]
    return Layout(row_token, block_expert, pair_row, dropped)


def _weights_for(weight: torch.Tensor, index: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The blocks' experts' weights, as the right operand of ``x @ w``: (blocks, in, out)."""
    picked = weight.index_select(0, index)
    return picked if transposed else picked.transpose(1, 2)


def _groups(blocks: int, experts: int) -> list[slice]:
    step = max(1, experts)
    return [slice(start, min(blocks, start + step)) for start in range(0, blocks, step)]


class _BlockLinear(torch.autograd.Function):
    """``x[b] @ W[expert of block b]`` for every block, saving ``x`` and the weights themselves for backward
    (not the gathered copies, which would hold up to 1.5x the layer's expert weights per projection until backward).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, block_expert: torch.Tensor, transposed: bool) -> Any:
        ctx.save_for_backward(x, weight, block_expert)
        ctx.transposed = transposed
        # Backward runs under the forward's autocast state (what torch.amp.custom_bwd does, for any device type).
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        groups = _groups(x.size(0), weight.size(0))
        parts = [torch.bmm(x[g], _weights_for(weight, block_expert[g], transposed)) for g in groups]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight, block_expert = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _BlockLinear._grads(ctx, grad, x, weight, block_expert)

    @staticmethod
    def _grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, block_expert: torch.Tensor) -> Any:
        transposed = ctx.transposed
        grad_x = grad_weight = None
        groups = _groups(x.size(0), weight.size(0))
        if ctx.needs_input_grad[0]:
            parts = [
                torch.bmm(grad[g], _weights_for(weight, block_expert[g], transposed).transpose(1, 2)) for g in groups
            ]
            grad_x = parts[0] if len(parts) == 1 else torch.cat(parts)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight)
            for g in groups:
                per_block = torch.bmm(x[g].transpose(1, 2), grad[g])  # (blocks, in, out)
                per_block = per_block if transposed else per_block.transpose(1, 2)
                grad_weight.index_add_(0, block_expert[g], per_block.to(weight.dtype))
        return grad_x, grad_weight, None, None


def _project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    block_expert: torch.Tensor | None,
    transposed: bool,
) -> torch.Tensor:
    """(blocks, rows per block, in) through each block's expert -> (blocks, rows per block, out)."""
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(weight.dtype)  # as upstream's grouped_mm: activations in the weights' dtype
    if block_expert is None:  # capacity mode: block b is expert b
        out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
        return out if bias is None else out + bias.unsqueeze(1)
    out = _BlockLinear.apply(x, weight, block_expert, transposed)
    return out if bias is None else out + bias.index_select(0, block_expert).unsqueeze(1)


def experts_forward(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, spec: Plan
) -> tuple[torch.Tensor, Layout]:
    """Transformers' experts interface, blockwise: ``module`` carries the experts' weights and flags
    (``has_gate``, ``has_bias``, ``is_transposed``, ``_apply_gate``, ...); returns the output and the layout."""
    num_experts = module.num_experts
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    valid = None
    if getattr(module, "_is_expert_parallel", False):
        # Pairs routed to another rank's experts carry ids >= num_experts: no row, and out of the gradient.
        valid = expert_ids < num_experts
        weights = weights.masked_fill(~valid, 0.0)
        expert_ids = expert_ids.clamp(max=num_experts - 1)
    plan_ = layout(expert_ids, valid, spec)
    x = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_dim)]).index_select(0, plan_.row_token)
    x = x.view(spec.blocks, spec.block, hidden_dim)
    has_bias = getattr(module, "has_bias", False)
    transposed = getattr(module, "is_transposed", False)
    if module.has_gate:
        up = _project(
            x, module.gate_up_proj, module.gate_up_proj_bias if has_bias else None, plan_.block_expert, transposed
        )
        act = module._apply_gate(up.reshape(spec.rows, -1))
    else:
        up = _project(x, module.up_proj, module.up_proj_bias if has_bias else None, plan_.block_expert, transposed)
        act = module.act_fn(up.reshape(spec.rows, -1))
    act = act.reshape(spec.blocks, spec.block, -1)
    out = _project(act, module.down_proj, module.down_proj_bias if has_bias else None, plan_.block_expert, transposed)
    out = out.reshape(spec.rows, hidden_dim)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    # A pair without a row (dropped, or another rank's) reads the zero row past the last.
    out = torch.cat([out, out.new_zeros(1, hidden_dim)]).index_select(0, plan_.pair_row)
    weighted = out * weights.unsqueeze(-1)
    final = weighted.view(num_tokens, top_k_index.size(-1), hidden_dim).sum(dim=1)
    return final.to(hidden_states.dtype), plan_
