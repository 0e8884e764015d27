"""Expert parallelism on Neuron: a training step takes the all-reduce exchange when the EP group shares its batch.

Transformers' ``AutoEP`` (``DistributedConfig(ep_size=...)``, ``ep_implementation="auto"``) runs ``AllReduceEP``
at inference when every rank of the EP group holds the same batch (``ep_size == tp_size``), and ``AllToAllEP``
everywhere else, training included. ``AllToAllEP`` reads each layer's split sizes back to the host and exchanges
blocks sized by the routing: on Neuron a compiled step breaks at every MoE layer, and its shapes (eager op
signatures, graphs) follow the routing, which is what the ``neuron_static`` experts exist to avoid.

``AllReduceEP`` has fixed shapes and a backward: each rank runs its own experts on the shared batch (routes to
other ranks' experts masked), an all-reduce sums the outputs, and the shared inputs' partial gradients are summed
over the group. So on Neuron, when the EP group shares its batch, ``AutoEP`` takes it in training too. Cost per
MoE layer: one all-reduce of the layer's output (forward) and of its input's gradient (backward) instead of two
all-to-alls each way; each rank runs its experts on the whole batch, which ``neuron_static``'s dense path does
for every token it gets anyway. With ``ep_size > tp_size`` the ranks of an EP group hold different batches: only
the all-to-all exchange can serve them, and it is left as it is. An explicit ``ep_implementation`` is kept.
"""

from __future__ import annotations

import inspect
from typing import Any

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts


def _picks_all_to_all_for_training(original: Any) -> str | None:
    source = inspect.getsource(original)
    if "self.all_reduce" in source and "is_grad_enabled" in source:
        return None
    return "this release's AutoEP does not keep the all-reduce exchange for inference only"


def _wrap(original: Any) -> Any:
    def __call__(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        if (
            getattr(self, "all_reduce", None) is not None  # the EP group shares its batch (ep_size == tp_size)
            and getattr(self, "megamoe", None) is None
            and hidden_states.device.type == DEVICE_TYPE
            and experts.mode() != "off"
        ):
            return self.all_reduce(hidden_states, top_k_index, top_k_weights)
        return original(self, hidden_states, top_k_index, top_k_weights)

    return __call__


def patches() -> list[Patch]:
    return [
        Patch(
            "transformers.distributed.expert_parallel",
            "AutoEP.__call__",
            _wrap,
            reason="expert parallelism on Neuron trains through the all-reduce exchange when the EP group shares "
            "its batch (ep_size == tp_size): fixed shapes, no host read of split sizes per layer, so a compiled "
            "step neither breaks at every MoE layer nor follows the routing",
            lacking="every release with DistributedConfig(ep_size): AutoEP exchanges tokens with all_to_all in "
            "training",
            params=("self", "hidden_states", "top_k_index", "top_k_weights"),
            needed=_picks_all_to_all_for_training,
        )
    ]
