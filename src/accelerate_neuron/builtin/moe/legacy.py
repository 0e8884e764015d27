"""Transformers 4.57's MoE layers on Neuron: the same blockwise / gathered / dense experts as the interface's.

Those releases have no experts interface: each family's MoE layer finds the experts the
routing hit (``nonzero``, ``torch.where``, ``expert_size.tolist()``) and runs each on the
tokens routed to it, so the number of expert calls and every expert's batch size change with
the routing (new eager signatures, or a new graph, per routing), and the models are marked as
not compilable. On Neuron each layer here keeps the family's own routing (the same ops, so
the same router outputs and auxiliary loss) and hands the pairs to
:func:`.experts.sparse_forward` with the experts' weights stacked (:mod:`.weights`). A loop
over the experts adds each token's outputs in ascending expert order, so the pairs are put in
that order first: the sums are upstream's.

Families: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE and Qwen3-Next (sparse blocks with a softmax
top-k router; the last two with a gated shared expert), DeepSeek-V3 and GLM-4 MoE (their
``moe`` method: routing and shared experts stay upstream's), GraniteMoE (its parallel experts)
and gpt-oss (its experts). Llama 4 is in :mod:`.llama4` (the same layer in both releases).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts, weights


def softmax_top_k(block: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits, expert ids, weights) as these blocks route: softmax in float, top-k, optionally normalised."""
    router_logits = block.gate(hidden_states)
    routing_weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):  # Mixtral always normalises; the others when configured to
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    return router_logits, selected_experts, routing_weights.to(hidden_states.dtype)


def _sparse_block(gate: str, up: str, down: str) -> Callable[[Any, torch.Tensor], Any]:
    def forward(block: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        jitter = getattr(block, "jitter_noise", 0)
        if block.training and jitter > 0:  # Mixtral's router jitter, as upstream applies it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits, index, routing_weights = softmax_top_k(block, hidden_states)
        index, routing_weights = experts.in_expert_order(index, routing_weights)
        stacked = weights.from_mlps(block.experts, gate, up, down)
        out = experts.sparse_forward(stacked, hidden_states, index, routing_weights, owner=block)
        shared = getattr(block, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE, Qwen3-Next: a shared expert behind a sigmoid gate
            out = out + torch.sigmoid(block.shared_expert_gate(hidden_states)) * shared(hidden_states)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits

    return forward


def shared_experts_moe(module: Any, hidden_states: torch.Tensor, topk_indices: Any, topk_weights: Any) -> Any:
    """DeepSeek-V3 / GLM-4 MoE's ``moe``: the routed experts only (their router and shared experts are upstream's)."""
    index, routing_weights = experts.in_expert_order(topk_indices, topk_weights)
    stacked = weights.from_mlps(module.experts, "gate_proj", "up_proj", "down_proj")
    out = experts.sparse_forward(stacked, hidden_states, index, routing_weights, owner=module)
    return out.type(hidden_states.dtype)


def granite_moe_forward(module: Any, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GraniteMoE's MoE layer: its top-k router (softmax over the top-k logits), then its parallel experts."""
    batch_size, length, hidden_dim = layer_input.size()
    hidden_states = layer_input.reshape(-1, hidden_dim)
    router_logits = module.router.layer(hidden_states).float()
    top_k_logits, index = router_logits.topk(module.router.top_k, dim=1)
    gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    index, gates = experts.in_expert_order(index, gates)
    stacked = weights.ExpertWeights(
        module.input_linear.num_experts, module.input_linear.weight, module.output_linear.weight, module.activation
    )
    out = experts.sparse_forward(stacked, hidden_states, index, gates, owner=module)
    return out.view(batch_size, length, hidden_dim), router_logits


def gpt_oss_experts_forward(
    module: Any, hidden_states: torch.Tensor, router_indices: Any = None, routing_weights: Any = None
) -> torch.Tensor:
    """gpt-oss's experts: biased, ``(experts, in, out)`` weights, a clamped SwiGLU on interleaved gate/up columns."""
    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, module.hidden_size)
    index, pair_weights = experts.in_expert_order(router_indices, routing_weights.gather(1, router_indices))

    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate_part, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate_part = gate_part.clamp(min=None, max=module.limit)
        up = up.clamp(min=-module.limit, max=module.limit)
        return (up + 1) * (gate_part * torch.sigmoid(gate_part * module.alpha))

    stacked = weights.ExpertWeights(
        module.num_experts,
        module.gate_up_proj,
        module.down_proj,
        act_fn=torch.nn.functional.silu,  # unused: the family's own gate
        is_transposed=True,
        gate_up_proj_bias=module.gate_up_proj_bias,
        down_proj_bias=module.down_proj_bias,
        gate=gate,
    )
    out = experts.sparse_forward(stacked, hidden_states, index, pair_weights, owner=module)
    return out.view(batch_size, -1, module.hidden_size)


@dataclass(frozen=True)
class Layer:
    """One 4.57 MoE layer this module replaces on Neuron."""

    module: str
    attr: str  # "Class.method"
    forward: Callable[..., Any]
    params: tuple[str, ...]
    markers: tuple[str, ...]  # what the original's source must contain: the routing-dependent loop this replaces
    pretrained: str = ""  # the family's pretrained-model class, whose models compile whole once the layer is static


_SOFTMAX_MARKERS = ("expert_mask", "self.gate(", "self.experts", "torch.where")
_MODELS = "transformers.models"
LAYERS = (
    Layer(
        f"{_MODELS}.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock.forward",
        _sparse_block("gate_proj", "up_proj", "down_proj"),
        ("self", "hidden_states"),
        _SOFTMAX_MARKERS,
        "Qwen3MoePreTrainedModel",
    ),
    Layer(
        f"{_MODELS}.mixtral.modeling_mixtral",
        "MixtralSparseMoeBlock.forward",
        _sparse_block("w1", "w3", "w2"),
        ("self", "hidden_states"),
        _SOFTMAX_MARKERS,
        "MixtralPreTrainedModel",
    ),
    Layer(
        f"{_MODELS}.olmoe.modeling_olmoe",
        "OlmoeSparseMoeBlock.forward",
        _sparse_block("gate_proj", "up_proj", "down_proj"),
        ("self", "hidden_states"),
        _SOFTMAX_MARKERS,
        # Not made compilable: 4.57's OLMoE attention builds its 4D mask in a way a static cache breaks.
    ),
    Layer(
        f"{_MODELS}.qwen2_moe.modeling_qwen2_moe",
        "Qwen2MoeSparseMoeBlock.forward",
        _sparse_block("gate_proj", "up_proj", "down_proj"),
        ("self", "hidden_states"),
        (*_SOFTMAX_MARKERS, "shared_expert_gate"),
        "Qwen2MoePreTrainedModel",
    ),
    Layer(
        f"{_MODELS}.qwen3_next.modeling_qwen3_next",
        "Qwen3NextSparseMoeBlock.forward",
        _sparse_block("gate_proj", "up_proj", "down_proj"),
        ("self", "hidden_states"),
        (*_SOFTMAX_MARKERS, "shared_expert_gate"),
    ),
    Layer(
        f"{_MODELS}.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3MoE.moe",
        shared_experts_moe,
        ("self", "hidden_states", "topk_indices", "topk_weights"),
        ("torch.where", "self.experts", "index_add_"),
        # Not made compilable: 4.57's static cache cannot hold MLA's keys (their head size is not the values').
    ),
    Layer(
        f"{_MODELS}.glm4_moe.modeling_glm4_moe",
        "Glm4MoeMoE.moe",
        shared_experts_moe,
        ("self", "hidden_states", "topk_indices", "topk_weights"),
        ("torch.where", "self.experts", "index_add_"),
        "Glm4MoePreTrainedModel",
    ),
    Layer(
        f"{_MODELS}.granitemoe.modeling_granitemoe",
        "GraniteMoeMoE.forward",
        granite_moe_forward,
        ("self", "layer_input"),
        ("self.router(", "expert_size", "self.input_linear(", "index_add"),
        "GraniteMoePreTrainedModel",
    ),
    Layer(
        f"{_MODELS}.gpt_oss.modeling_gpt_oss",
        "GptOssExperts.forward",
        gpt_oss_experts_forward,
        ("self", "hidden_states", "router_indices", "routing_weights"),
        ("expert_hit", "routing_weights", "self.gate_up_proj"),
    ),
)


def _interface() -> bool:
    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError:
        return False
    return hasattr(moe, "ExpertsInterface")


def _loops_over_hit_experts(layer: Layer) -> Callable[[Any], str | None]:
    def needed(original: Any) -> str | None:
        if _interface():
            return "this release runs experts through the experts interface (the 'neuron_static' implementation)"
        source = inspect.getsource(original)
        if all(marker in source for marker in layer.markers):
            return None
        return "this release's layer does not loop over the experts the routing hit"

    return needed


def _wrap(replacement: Callable[..., Any]) -> Callable[[Any], Any]:
    def wrap(original: Any) -> Any:
        def forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if hidden_states.device.type != DEVICE_TYPE or experts.mode() == "off":
                return original(self, hidden_states, *args, **kwargs)
            return replacement(self, hidden_states, *args, **kwargs)

        return forward

    return wrap


def _compilable(_original: Any) -> property:
    # Read on instances only (in 4.57 by accelerate-neuron's generate() alone: static cache and compiled decode).
    return property(lambda _self: experts.mode() != "off")


def _layer_needed(layer: Layer) -> Callable[[Any], str | None]:
    def needed(_original: Any) -> str | None:
        module = importlib.import_module(layer.module)
        owner: Any = module
        for part in layer.attr.split("."):
            owner = getattr(owner, part)
        return _loops_over_hit_experts(layer)(owner)

    return needed


def patches(why: str) -> list[Patch]:
    out = []
    for layer in LAYERS:
        cls = layer.attr.split(".")[0]
        out.append(
            Patch(
                layer.module,
                layer.attr,
                _wrap(layer.forward),
                reason=f"{cls} on Neuron: {why}",
                lacking="Transformers < 5 (a Python loop over the experts the routing hit)",
                params=layer.params,
                needed=_loops_over_hit_experts(layer),
            )
        )
        if layer.pretrained:
            out.append(
                Patch(
                    layer.module,
                    f"{layer.pretrained}._can_compile_fullgraph",
                    _compilable,
                    reason=f"{layer.pretrained}: its models compile whole once the MoE layer's shapes are static "
                    "(upstream says False because of the layer's data-dependent loop), so generate() gets a static "
                    "cache and a compiled decode step as dense models do",
                    lacking="Transformers < 5",
                    needed=_layer_needed(layer),
                )
            )
    return out
