"""Expert parallelism on Neuron with fixed-size exchanges: one graph per step shape, whatever the routing.

Transformers' ``AutoEP`` (``DistributedConfig(ep_size=...)``, ``ep_implementation="auto"``) runs ``AllReduceEP``
at inference when every rank of the EP group holds the same batch (``ep_size == tp_size``), and ``AllToAllEP``
everywhere else, training included. ``AllToAllEP`` reads each layer's split sizes back to the host and exchanges
blocks sized by the routing: on Neuron a compiled step breaks at every MoE layer, and its shapes (eager op
signatures, graphs) follow the routing, which is what the ``neuron_static`` experts exist to avoid.

On Neuron ``AutoEP`` takes instead:

- **the EP group shares its batch** (``ep_size == tp_size``): upstream's ``AllReduceEP``, in training too. It has
  fixed shapes and a backward (each rank runs its experts on the shared batch, an all-reduce sums the outputs, the
  shared inputs' partial gradients are summed over the group).
- **the ranks of the EP group hold different batches** (``ep_size > tp_size``): :func:`gather_exchange`. Every rank
  all-gathers the group's tokens and routing (a fixed-size buffer: ``ep_size x tokens`` rows), runs its own
  experts on the pairs routed to them (other ranks' pairs get no row), and a reduce-scatter hands each rank the
  sums for its own tokens. Dropless by construction: the experts' blockwise layout is sized for the worst case,
  every pair of the group routed to this rank's experts, so a rank computes up to ``ep_size`` times its share of a
  sparse dispatch (``ACCELERATE_NEURON_MOE_CAPACITY_FACTOR`` caps that, dropping what overflows). Bytes per MoE
  layer and rank: ``(ep_size - 1) x tokens x hidden`` in, the same out, against ``tokens x top_k x hidden`` each
  way for an all-to-all of the pairs when nothing is dropped. Its collectives are functional collectives with a
  backward (all-gather <-> reduce-scatter), which Dynamo keeps inside one graph. Ranks of one TP group hand in
  the same batch and each computes it (``tp_size`` times the work of slicing it over TP first).

It is also registered as ``ep_implementation="neuron_all_gather"``. An explicit ``ep_implementation`` is kept;
``ACCELERATE_NEURON_MOE_EXPERTS=off`` restores upstream's choice.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...device import DEVICE_TYPE
from ...patching import Patch
from . import experts

#: The name :func:`gather_exchange` is registered under in ``EPImplementationInterface``.
KEY = "neuron_all_gather"
MODULE = "transformers.distributed.expert_parallel"


def _collectives() -> tuple[Any, Any, Any]:
    """(all-gather with a backward, reduce-scatter with a backward, all-gather without): functional collectives,
    by the names of torch >= 2.14, else the older ones."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
    plain = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather, scatter, plain


class _Wait(torch.autograd.Function):
    """Wait on a functional collective's result; identity backward (``wait_tensor`` has no autograd kernel in
    every release)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import wait_tensor

        return wait_tensor(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return _Wait.apply(tensor)


def _tp_slices(impl: Any, tensors: tuple[torch.Tensor, ...], sentinel: int) -> tuple[torch.Tensor, ...]:
    """The rows this rank handles when its TP group shares the batch: an equal slice each (the batch padded to a
    multiple of ``tp_size``: zero rows, routed nowhere), as upstream's ``AllToAllEP`` slices it (whose backward
    all-gathers the rows' gradients), so no token is computed twice."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = impl.tp_mesh.size()
    rows = tensors[0].size(0)
    pad = -rows % tp
    if pad:
        hidden, index, weights = tensors
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        index = torch.nn.functional.pad(index, (0, 0, 0, pad), value=sentinel)
        weights = torch.nn.functional.pad(weights, (0, 0, 0, pad))
        tensors = (hidden, index, weights)
    return tuple(
        DTensor.from_local(t, impl.tp_mesh, [Replicate()], run_check=False)
        .redistribute(impl.tp_mesh, [Shard(0)])
        .to_local()
        for t in tensors
    )


def gather_exchange(
    impl: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """All-gather the EP group's tokens and routing, run this rank's experts on its pairs, reduce-scatter back.

    ``impl`` is an upstream ``EPImplementation`` (``experts_forward``, ``num_local_experts``, ``ep_mesh``,
    ``tp_mesh``).
    """
    group = impl.ep_mesh.get_group()
    rank = impl.ep_mesh.get_local_rank()
    local_experts = impl.num_local_experts
    num_tokens, hidden_dim = hidden_states.shape
    tp = impl.tp_mesh.size()
    if tp > 1:
        sentinel = local_experts * impl.ep_mesh.size()  # past every rank's experts
        hidden_states, top_k_index, top_k_weights = _tp_slices(
            impl, (hidden_states, top_k_index, top_k_weights), sentinel
        )
    gather, scatter, gather_ids = _collectives()
    hidden_all = _wait(gather(hidden_states.contiguous(), 0, group))
    weights_all = _wait(gather(top_k_weights.contiguous(), 0, group))
    index_all = _wait(gather_ids(top_k_index.contiguous(), 0, group))
    # Global expert ids -> this rank's; another rank's pairs get the sentinel id the experts skip.
    local = index_all - rank * local_experts
    mine = (local >= 0) & (local < local_experts)
    local_index = torch.where(mine, local, local_experts)
    out = impl.experts_forward(hidden_all, local_index, weights_all.masked_fill(~mine, 0.0))
    out = _wait(scatter(out.contiguous(), "sum", 0, group))
    if tp == 1:
        return out
    from torch.distributed.tensor import DTensor, Shard

    rows = out.size(0) * tp
    full = DTensor.from_local(
        out.contiguous(), impl.tp_mesh, [Shard(0)], shape=(rows, hidden_dim), stride=(hidden_dim, 1)
    )
    return full.full_tensor()[:num_tokens]


def _gather_ep_class(base: type) -> type:
    class NeuronAllGatherEP(base):  # type: ignore[misc, valid-type]
        """All-gather the EP group's tokens, run the local experts, reduce-scatter: fixed shapes, dropless."""

        def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            return gather_exchange(self, hidden_states, top_k_index, top_k_weights)

    return NeuronAllGatherEP


def _with_key(mapping: dict[str, Any]) -> dict[str, Any]:
    from transformers.distributed.expert_parallel import EPImplementation

    return {**mapping, KEY: _gather_ep_class(EPImplementation)}


def _picks_all_to_all_for_training(original: Any) -> str | None:
    source = inspect.getsource(original)
    if "self.all_reduce" in source and "self.all_to_all" in source:
        return None
    return "this release's AutoEP does not choose between the all-reduce and all-to-all exchanges"


def _wrap(original: Any) -> Any:
    def __call__(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        if (
            getattr(self, "megamoe", None) is None
            and hidden_states.device.type == DEVICE_TYPE
            and experts.mode() != "off"
        ):
            if getattr(self, "all_reduce", None) is not None:  # the EP group shares its batch (ep_size == tp_size)
                return self.all_reduce(hidden_states, top_k_index, top_k_weights)
            return gather_exchange(self, hidden_states, top_k_index, top_k_weights)
        return original(self, hidden_states, top_k_index, top_k_weights)

    return __call__


def patches() -> list[Patch]:
    return [
        Patch(
            MODULE,
            "AutoEP.__call__",
            _wrap,
            reason="expert parallelism on Neuron exchanges fixed-size buffers: the all-reduce exchange when the EP "
            "group shares its batch (ep_size == tp_size), training included; an all-gather of the group's tokens "
            "and a reduce-scatter of the outputs when it does not (ep_size > tp_size). No host read of split sizes "
            "per layer, so a compiled step is one graph per shape, not pieces that follow the routing",
            lacking="every release with DistributedConfig(ep_size): AutoEP exchanges tokens with all_to_all in "
            "training and whenever ep_size > tp_size",
            params=("self", "hidden_states", "top_k_index", "top_k_weights"),
            needed=_picks_all_to_all_for_training,
        ),
        Patch(
            MODULE,
            "EPImplementationInterface._global_mapping",
            _with_key,
            reason=f"registers ep_implementation='{KEY}': the EP group's tokens all-gathered, each rank's experts "
            "on the pairs routed to them, the outputs reduce-scattered (fixed shapes, dropless)",
            lacking="every release (its EP exchanges with fixed shapes need every rank to hold the same batch)",
        ),
    ]
