"""Fully sharded data parallelism that Dynamo traces: one graph per training step instead of one per FSDP unit.

Transformers' ``DistributedConfig(fsdp_size=N)`` applies FSDP2's ``fully_shard`` to every decoder layer, the
embeddings, the head and the root. FSDP2 runs its hooks outside Dynamo by design (``torch._dynamo.disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``): every unit is a graph boundary, and its all-gathers and
reduce-scatters run eagerly between graphs. On Neuron a compiled training step of an L-layer model is then
about ``2 x (L + 4)`` graphs, each its own NEFF launch with a device->host->device hop between two.

Here the same sharding is expressed with DTensor, which Dynamo traces into the graph as functional collectives
(the "SimpleFSDP" formulation): each parameter is kept sharded as a DTensor over the FSDP mesh (and the TP mesh
with TP, the same layout FSDP2 gives it, so loading, saving, the optimizer and gradient clipping see what they
see with FSDP2), and reading it in a forward all-gathers it (``redistribute`` to ``Replicate``), whose backward is
a reduce-scatter of the gradient, averaged over the FSDP group as FSDP2 does. A compiled step is then one forward
and one backward graph with the collectives inside, which the compiler can schedule and overlap.

Memory: a weight gathered in the forward is kept for the backward that needs it (like FSDP2's
``reshard_after_forward=False``), except under gradient checkpointing, where a checkpointed layer gathers its
weights again when the backward recomputes it (like ``reshard_after_forward=True``). Parameters, gradients and
optimizer state stay sharded between steps, as with FSDP2.

With TP, a parameter TP left a plain tensor reads as a plain tensor (as with FSDP2), and the norms of TP's
``replicated_with_grad_allreduce`` style (whose gradient upstream all-reduces over TP in a post-accumulate hook,
which cannot run on a DTensor gradient) have their gradient summed over TP by the traced backward instead.

Stands aside (upstream's ``fully_shard`` applies) for expert parallelism, HSDP (``dp_replicate_size > 1``),
CPU offload, FSDP's mixed-precision policy, pipeline parallelism, a parameter on a mesh other than TP's, and off
Neuron; ``ACCELERATE_NEURON_FSDP_IMPLEMENTATION=fully_shard`` chooses upstream's everywhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ... import logs, settings

logger = logging.getLogger(__name__)

SETTING = "fsdp_implementation"
#: Set on a module whose parameters this module shards (upstream sets ``_is_fsdp_managed_module`` on the root).
MARK = "_accelerate_neuron_traced_fsdp"
#: A sharded module's own sharded parameters, by name.
_SHARDED = "_accelerate_neuron_sharded_params"


def _distributed_config(model: Any) -> Any:
    return getattr(getattr(model, "config", None), "distributed_config", None)


def _why_not(model: Any, mesh_manager: Any) -> str | None:
    """Why the traced form cannot shard this model (None: it can)."""
    if settings.get(SETTING) != "auto":
        return f"{settings.env_name(SETTING)}={settings.get(SETTING)}"
    config = _distributed_config(model)
    if config is None:
        return "no distributed_config"
    for attr, why in (
        ("ep_size", "expert parallelism"),
        ("dp_replicate_size", "HSDP (dp_replicate_size > 1)"),
        ("pp_size", "pipeline parallelism"),
    ):
        if int(getattr(config, attr, 1) or 1) > 1:
            return why
    if getattr(config, "fsdp_cpu_offload", False):
        return "fsdp_cpu_offload"
    if getattr(config, "fsdp_mixed_precision", False):
        return "fsdp_mixed_precision (FSDP's MixedPrecisionPolicy)"
    fsdp_mesh = mesh_manager.get_mesh("fsdp")
    if fsdp_mesh.device_type != "neuron":
        return f"the mesh is on {fsdp_mesh.device_type}, not Neuron"
    from torch.distributed.tensor import DTensor

    tp_mesh = mesh_manager.get_mesh("tp") if int(getattr(config, "tp_size", 1) or 1) > 1 else None
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and (tp_mesh is None or param.device_mesh != tp_mesh):
            return f"{name} is a DTensor on a mesh other than TP's ({param.device_mesh.mesh_dim_names})"
    return None


def _fsdp_dim(shape: torch.Size, taken: set[int], size: int) -> int | None:
    """The dimension the FSDP group shards: the first one TP does not shard whose length ``size`` divides."""
    return next((d for d, n in enumerate(shape) if d not in taken and n % size == 0 and n >= size), None)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (FSDP2's average over the group, with a sum reduction: the
    simulated group and gloo have no AVG)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _Read(NamedTuple):
    """How a sharded parameter reads in a forward."""

    #: The TP mesh of a parameter TP sharded as a DTensor (it reads as TP's DTensor), None for a plain one.
    tp_mesh: Any
    #: Its gradient is partial over the TP group too (TP's ``replicated_with_grad_allreduce``: a norm that sees
    #: only this rank's heads), summed by the traced backward instead of upstream's all-reduce hook.
    grad_sums_tp: bool = False


def _gather(param: Any, read: _Read, group_size: int) -> Any:
    """The full weight (TP's shard of it, as a DTensor on the TP mesh, with TP) for a forward to use."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    tp_placements = tuple(param.placements)[1:]
    gathered = param.redistribute(param.device_mesh, (Replicate(), *tp_placements))
    # Each rank computed its own batch's gradient: partial sums over the FSDP group, reduce-scattered back.
    grad_tp = tuple(Partial() for _ in tp_placements) if read.grad_sums_tp else tp_placements
    local = gathered.to_local(grad_placements=(Partial(), *grad_tp))
    local = _ScaleGrad.apply(local, 1.0 / group_size)
    if read.tp_mesh is None:
        return local
    return DTensor.from_local(
        local, read.tp_mesh, tp_placements, run_check=False, shape=gathered.shape, stride=gathered.stride()
    )


class _Reading:
    """How many forwards of sharded modules are running: inside one, a sharded parameter reads as its gathered
    weight; outside (loading, tying, saving, the optimizer), as the sharded parameter itself, as with FSDP2."""

    depth = 0


_reading = _Reading()


def _forward_gathering(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, during which sharded parameters read as their gathered weights (also when gradient
    checkpointing runs it again in the backward)."""

    @functools.wraps(forward)
    def gathering_forward(*args: Any, **kwargs: Any) -> Any:
        _reading.depth += 1
        try:
            return forward(*args, **kwargs)
        finally:
            _reading.depth -= 1

    return gathering_forward


def _accessor(name: str, read: _Read, group_size: int) -> property:
    from torch.distributed.tensor import DTensor

    def get(module: torch.nn.Module) -> Any:
        param = module._parameters[name]
        if param is None or _reading.depth == 0:
            return param
        if not isinstance(param, DTensor):  # upstream's local-tensor kernels (TP inference) swapped in the local
            full = _gather(module.__dict__[_SHARDED][name], read, group_size)
            return full.to_local() if isinstance(full, DTensor) else full
        return _gather(param, read, group_size)

    return property(get)


def _sharded_class(cls: type, reads: tuple[tuple[str, _Read], ...], group_size: int) -> type:
    """A subclass of ``cls`` (same name) whose sharded parameters (``reads``: name, how it reads) read as their
    gathered weights in a forward."""
    sub = type(cls.__name__, (cls,), {n: _accessor(n, read, group_size) for n, read in reads})
    sub.__qualname__ = cls.__qualname__
    sub.__module__ = cls.__module__
    setattr(sub, MARK, True)
    return sub


def _shard_param(param: torch.Tensor, mesh: Any, fsdp_mesh: Any, tp_mesh: Any) -> torch.nn.Parameter:
    """``param`` (plain, or TP's DTensor) as a DTensor sharded over the FSDP group too: its first dimension TP
    does not shard that the group size divides, or else replicated over the group."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(param, DTensor):
        tp_placements, local = tuple(param.placements), param.to_local()
    else:
        tp_placements, local = ((Replicate(),) if tp_mesh is not None else ()), param.data
    group_size = fsdp_mesh.size()
    taken = {p.dim % param.ndim for p in tp_placements if isinstance(p, Shard)}
    dim = _fsdp_dim(local.shape, taken, group_size)
    mine = local if dim is None else local.chunk(group_size, dim)[fsdp_mesh.get_local_rank()]
    sharded = DTensor.from_local(
        mine if mine.is_meta else mine.contiguous(),
        mesh,
        (Shard(dim) if dim is not None else Replicate(), *tp_placements),
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return torch.nn.Parameter(sharded, requires_grad=param.requires_grad)


#: Transformers' TP style whose forward pre-hook registers, on the first forward, a post-accumulate-grad hook that
#: all-reduces a plain parameter's gradient over the TP group (``tensor_parallel.py``).
_GRAD_ALL_REDUCE = "ReplicatedWithGradAllReduce."


def _drop_grad_all_reduce(module: torch.nn.Module) -> bool:
    """Remove TP's gradient all-reduce hook from ``module`` (the traced backward sums the gradient over TP); whether
    it had one."""
    hooks = [
        k for k, h in module._forward_pre_hooks.items() if getattr(h, "__qualname__", "").startswith(_GRAD_ALL_REDUCE)
    ]
    for key in hooks:
        del module._forward_pre_hooks[key]
    return bool(hooks)


def shard(model: torch.nn.Module, mesh_manager: Any) -> torch.nn.Module:
    """Shard every parameter of ``model`` over the FSDP mesh (and TP's), read through traced all-gathers."""
    config = _distributed_config(model)
    tp = int(getattr(config, "tp_size", 1) or 1)
    fsdp_mesh = mesh_manager.get_mesh("fsdp")
    tp_mesh = mesh_manager.get_mesh("tp") if tp > 1 else None
    mesh = mesh_manager.get_mesh(("fsdp", "tp")) if tp_mesh is not None else fsdp_mesh
    from torch.distributed.tensor import DTensor

    sharded: dict[int, tuple[torch.nn.Parameter, _Read]] = {}
    classes: dict[tuple[type, tuple[tuple[str, _Read], ...]], type] = {}
    for module in model.modules():
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if not names:
            continue
        grad_sums_tp = _drop_grad_all_reduce(module) if tp_mesh is not None else False
        reads = []
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:  # a tied weight is one sharded parameter
                read = _Read(tp_mesh if isinstance(param, DTensor) else None, grad_sums_tp)
                sharded[id(param)] = (_shard_param(param, mesh, fsdp_mesh, tp_mesh), read)
            module._parameters[name], read = sharded[id(param)]
            reads.append((name, read))
        module.__dict__[_SHARDED] = {name: module._parameters[name] for name in names}
        key = (type(module), tuple(reads))
        if key not in classes:
            classes[key] = _sharded_class(type(module), tuple(reads), fsdp_mesh.size())
        module.__class__ = classes[key]
        module.forward = _forward_gathering(module.forward)
    model.forward = _forward_gathering(model.forward)  # a forward may read another module's weight (a tied head)
    model._is_fsdp_managed_module = True  # what generate() and Transformers look for (synced_gpus)
    # ... which Dynamo takes for FSDP1's flag: it traces such a module only with use_orig_params (a graph break
    # otherwise), as an unspecialized module; the parameters here are the original ones, sharded.
    model._fsdp_use_orig_params = True
    setattr(model, MARK, True)
    return model


def wrap_apply_fsdp(original: Callable[..., Any]) -> Callable[..., Any]:
    """Transformers' ``apply_fully_sharded_data_parallelism``: the traced form on Neuron where it applies."""

    @functools.wraps(original)
    def apply_fully_sharded_data_parallelism(
        model: Any, mesh_manager: Any, fsdp_plan: Any, ep_plan: Any, *args: Any, **kwargs: Any
    ) -> Any:
        why = _why_not(model, mesh_manager)
        if why is not None:
            logs.once(
                logger,
                ("tracing.fsdp_upstream", why),
                "accelerate_neuron: FSDP through upstream's fully_shard (%s): on Neuron each FSDP unit is then a "
                "graph boundary of a compiled step (docs/training.md, 'FSDP and TP x FSDP').",
                why,
            )
            return original(model, mesh_manager, fsdp_plan, ep_plan, *args, **kwargs)
        logs.once(
            logger,
            "tracing.fsdp_traced",
            "accelerate_neuron: FSDP on Neuron shards parameters as DTensors gathered inside the compiled step (one "
            "forward and one backward graph); %s=fully_shard chooses upstream's FSDP2.",
            settings.env_name(SETTING),
        )
        return shard(model, mesh_manager)

    return apply_fully_sharded_data_parallelism
