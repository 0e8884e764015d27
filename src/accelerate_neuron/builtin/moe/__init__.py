"""Built-in plugin ``moe``: mixture-of-experts layers on Neuron with shapes that do not depend on routing.

Transformers >= 5 runs experts through ``integrations/moe.py``'s experts interface.
This plugin registers :data:`.experts.KEY` there and makes it what a model gets when
nobody asked for an implementation (upstream would pick ``grouped_mm``, whose group
sizes follow the routing and whose token count is an integer ``histc`` the Neuron
compiler has no lowering for). Off Neuron it is ``grouped_mm`` itself. A user's
``experts_implementation=...`` (``from_pretrained``, the config,
``set_experts_implementation``) wins. ``ACCELERATE_NEURON_MOE_EXPERTS`` chooses
``auto`` / ``blockwise`` / ``dense`` / ``off`` (:mod:`.experts`, :mod:`.blockwise`).

Transformers 4.57 loops over experts in Python inside each family's MoE layer
(:mod:`.legacy`); Llama 4 runs every expert on every token in both releases
(:mod:`.llama4`). The router's auxiliary loss counts experts without an integer
``histc`` on Neuron (:mod:`.aux_loss`). Expert parallelism exchanges fixed-size buffers
(:mod:`.expert_parallel`).
"""

from __future__ import annotations

from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch
from . import aux_loss, expert_parallel, experts, legacy, llama4

_WHY = (
    "experts on Neuron with shapes fixed by the token count (blockwise: the pairs sorted into blocks of one "
    "expert each, about a sparse dispatch's FLOPs; gathered weights for small decode batches) instead of "
    "routing-dependent groups and an integer histc: one compiled graph per shape, not per routing"
)


def _with_key(mapping: dict[str, Any]) -> dict[str, Any]:
    return {**mapping, experts.KEY: experts.static_experts_forward}


def _default_to_key(original: Any) -> Any:
    def get_correct_experts_implementation(self: Any, requested_experts: str | None) -> str:
        chosen = original(self, requested_experts)
        # Only upstream's own default is replaced; a requested implementation (even "grouped_mm") is kept.
        if requested_experts is None and chosen == "grouped_mm" and _replaceable(self):
            return experts.KEY
        return chosen

    return get_correct_experts_implementation


def _replaceable(model: Any) -> bool:
    if experts.mode() == "off" or not experts.registered():
        return False
    # Quantized experts (FP8) dispatch through their own interface, which does not know this key.
    return getattr(model.config, "quantization_config", None) is None


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        Patch(
            "transformers.integrations.moe",
            "ExpertsInterface._global_mapping",
            _with_key,
            reason=f"registers the '{experts.KEY}' experts implementation: {_WHY}",
            lacking="every release (no experts implementation with routing-independent shapes)",
            gone="this release has no experts interface (Transformers < 5): the sparse MoE blocks are patched instead",
        ),
        Patch(
            "transformers.modeling_utils",
            "PreTrainedModel.get_correct_experts_implementation",
            _default_to_key,
            reason=f"a model with no experts_implementation requested gets '{experts.KEY}' (grouped_mm off "
            f"Neuron): {_WHY}",
            lacking="every release with the experts interface (the default is grouped_mm on every device)",
            params=("self", "requested_experts"),
            gone="this release has no experts interface (Transformers < 5)",
        ),
        *legacy.patches(_WHY),
        *llama4.patches(_WHY),
        *aux_loss.patches(),
        *expert_parallel.patches(),
    ]
