"""The router's load-balancing loss on Neuron without an integer ``histc``.

Transformers >= 5 counts each expert's tokens with ``torch.histc`` on int32 ids off the
CPU when no attention mask is given (no lowering on Neuron: a host round trip per layer
per step, and an op a compiled training graph cannot hold). With a mask it counts with
``scatter_add_``, which lowers. On Neuron an all-ones mask over the router's rows is
passed instead of none: the counts, the probability sums and the row total are the same
numbers, so the loss is upstream's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts

#: Model modules whose ``load_balancing_loss_func`` this covers (the families the plugin is tested on).
MODULES = ("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.mixtral.modeling_mixtral")


def _counts_with_histc(original: Any) -> str | None:
    if "torch.histc(" in inspect.getsource(original) and "attention_mask" in inspect.signature(original).parameters:
        return None
    return "this release's load-balancing loss does not count experts with torch.histc"


def _wrap(original: Any) -> Any:
    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Any = None
    ) -> Any:
        if (
            attention_mask is None
            and isinstance(gate_logits, tuple)
            and gate_logits
            and gate_logits[0].device.type == DEVICE_TYPE
            and experts.mode() != "off"
        ):
            attention_mask = torch.ones(gate_logits[0].shape[0], device=gate_logits[0].device)
        return original(gate_logits, num_experts, top_k, attention_mask)

    return load_balancing_loss_func


def patches() -> list[Patch]:
    return [
        Patch(
            module,
            "load_balancing_loss_func",
            _wrap,
            reason="the router's auxiliary loss on Neuron counts tokens per expert with scatter_add_ (an all-ones "
            "mask) instead of an integer torch.histc, which has no Neuron lowering; same numbers",
            lacking="Transformers >= 5 (4.57 counts with one_hot)",
            params=("gate_logits", "num_experts", "top_k", "attention_mask"),
            needed=_counts_with_histc,
        )
        for module in MODULES
    ]
