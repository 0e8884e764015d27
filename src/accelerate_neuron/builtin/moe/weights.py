"""Experts that are not Transformers >= 5's stacked ``@use_experts_implementation`` modules, seen as if they were.

The blockwise, gathered and dense paths read an experts module's attributes (``num_experts``,
``gate_up_proj`` or ``up_proj``, ``down_proj``, ``has_gate``, ``is_transposed``, ``has_bias``,
``_apply_gate``, ...). :class:`ExpertWeights` offers the same attributes for the layouts other
families keep: a ``ModuleList`` of per-expert MLPs (Transformers 4.57's sparse MoE blocks, stacked
here on every call: one copy of the layer's expert weights, no FLOPs, gradients flow back to each
expert's ``Linear``), Llama 4's stacked ``(experts, in, out)`` weights, GraniteMoE's parallel
experts and 4.57's gpt-oss experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ExpertWeights:
    """The attributes the experts paths read, for experts kept in another layout."""

    num_experts: int
    gate_up_proj: torch.Tensor | None  # (experts, 2 x intermediate, hidden), or (experts, hidden, 2 x ...) transposed
    down_proj: torch.Tensor
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    is_transposed: bool = False
    gate_up_proj_bias: torch.Tensor | None = None
    down_proj_bias: torch.Tensor | None = None
    gate: Callable[[torch.Tensor], torch.Tensor] | None = None  # the family's own gate, when not act(gate) * up
    has_post_expert_norm: bool = False
    _is_expert_parallel: bool = False

    @property
    def has_gate(self) -> bool:
        return True

    @property
    def has_bias(self) -> bool:
        return self.gate_up_proj_bias is not None

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def from_mlps(experts: Sequence[Any], gate: str, up: str, down: str) -> ExpertWeights:
    """A ``ModuleList`` of gated MLPs (``down(act(gate(x)) * up(x))``), their ``Linear`` weights stacked."""
    gate_up = torch.stack([torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in experts])
    down_proj = torch.stack([getattr(e, down).weight for e in experts])
    first = experts[0]
    act = getattr(first, "act_fn", None) or first.activation_fn
    return ExpertWeights(len(experts), gate_up, down_proj, act)
