"""The router's load-balancing loss on Neuron: no integer ``histc``, and no crash inside ``generate()``.

Transformers >= 5 counts each expert's tokens with ``torch.histc`` on int32 ids off the
CPU when no attention mask is given (no lowering on Neuron: a host round trip per layer
per step, and an op a compiled training graph cannot hold). With a mask it counts with
``scatter_add_``, which lowers. On Neuron an all-ones mask over the router's rows is
passed instead of none: the counts, the probability sums and the row total are the same
numbers, so the loss is upstream's.

Both releases read a mask as ``[batch, sequence]`` over the router's rows. Inside
``generate()`` with a static cache (what ``generate()`` on Neuron always uses) the forward
gets the cache's 4D mask, and a cached decode step's 2D mask also covers the cache:
upstream raises on either (a broadcast or unpack error; on the CPU too, with a static
cache or a padded batch) whenever ``output_router_logits=True``. Such a mask says nothing
row by row, so on Neuron every row is counted, as without a mask. ``generate()`` discards
the auxiliary loss; a forward called with a ``[batch, sequence]`` mask keeps upstream's
masked loss.
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


def _takes_a_mask(original: Any) -> str | None:
    if "attention_mask" in inspect.signature(original).parameters:
        return None
    return "this release's load-balancing loss takes no attention mask"


def _counts_with_histc(original: Any) -> bool:
    return "torch.histc(" in inspect.getsource(original)


def _wrap(original: Any) -> Any:
    # What "no mask" becomes on Neuron: an all-ones mask where upstream would count with an integer histc
    # (>= 5); no mask where it counts with one_hot (4.57), its own exact unmasked path.
    histc = _counts_with_histc(original)

    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Any = None
    ) -> Any:
        if (
            isinstance(gate_logits, tuple)
            and gate_logits
            and gate_logits[0].device.type == DEVICE_TYPE
            and experts.mode() != "off"
            # No mask, or one not over the router's rows (a static cache's 4D mask, a decode step's cache-wide one).
            and (attention_mask is None or attention_mask.numel() != gate_logits[0].shape[0])
        ):
            rows = gate_logits[0].shape[0]
            # [rows, 1]: the [batch, sequence] layout 4.57 unpacks, and the flat rows >= 5 reshapes to.
            attention_mask = torch.ones((rows, 1), device=gate_logits[0].device) if histc else None
        return original(gate_logits, num_experts, top_k, attention_mask)

    return load_balancing_loss_func


def patches() -> list[Patch]:
    return [
        Patch(
            module,
            "load_balancing_loss_func",
            _wrap,
            reason="the router's auxiliary loss on Neuron counts tokens per expert with scatter_add_ (an all-ones "
            "mask) instead of an integer torch.histc, which has no Neuron lowering (same numbers); a mask not "
            "over the router's rows (generate()'s static-cache 4D mask, on which upstream raises with "
            "output_router_logits=True) counts every row",
            lacking="every release: >= 5 counts with an integer histc without a mask; 4.57 and >= 5 raise on "
            "generate()'s static-cache mask",
            params=("gate_logits", "num_experts", "top_k", "attention_mask"),
            needed=_takes_a_mask,
        )
        for module in MODULES
    ]
