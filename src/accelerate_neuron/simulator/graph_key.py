"""Stable cache keys for what the simulated device compiles: FX graphs and eager op signatures.

torch-neuronx keys a NEFF by a 128-bit hash of the lowered HLO plus its compile settings,
so the same graph hashes the same in every process and on every rank. Python's ``hash()``
is salted per process, and ``gm.code`` carries node names and source comments; the key
here is a SHA-256 (first 128 bits, 32 hex digits as torch-neuronx's) of a canonical JSON
description instead: each node's op, target and arguments (nodes by position, devices by
type: a NEFF is loaded on whichever core runs it), the inputs' shapes, dtypes and strides,
the values of tensor constants, the backend options, the torch and accelerate-neuron
versions, and the key inputs a real NEFF depends on besides its graph (compiler, ``NEURON_CC_FLAGS``,
target, LNC: :mod:`accelerate_neuron.compile_cache.keys`), so a changed flag or target misses as it
must on Neuron. Weights are graph inputs (AOTAutograd lifts them), so the same code run for two
modules of the same shapes is one key, as it is one HLO.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..compile_cache import keys

#: Bumped when the description changes, so older entries stop matching.
KEY_FORMAT = 1
#: Constants larger than this are keyed by shape and dtype only (reading them costs more than it tells).
MAX_HASHED_CONSTANT_BYTES = 64 * 2**20


@functools.cache
def versions() -> dict[str, str]:
    """What an entry is only valid for: a new torch or accelerate-neuron invalidates the cache."""
    try:
        own = importlib.metadata.version("accelerate-neuron")
    except importlib.metadata.PackageNotFoundError:
        own = "unknown"
    return {"torch": torch.__version__, "accelerate-neuron": own, "key_format": str(KEY_FORMAT)}


def digest(description: Mapping[str, Any]) -> str:
    """32 hex digits of SHA-256 over the canonical JSON of ``description``."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    # Python callables (operator.getitem, ...) by qualified name: their repr may hold an address.
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{getattr(target, '__qualname__', type(target).__qualname__)}"


def _tensor(value: torch.Tensor, *, content: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shape": [s if isinstance(s, int) else str(s) for s in value.shape],
        "dtype": str(value.dtype),
        "device": value.device.type,
    }
    try:
        out["stride"] = [s if isinstance(s, int) else str(s) for s in value.stride()]
    except Exception:  # sparse or opaque layouts have no strides
        out["layout"] = str(value.layout)
    if content:
        out["content"] = _content_digest(value)
    return out


def _content_digest(value: torch.Tensor) -> str | None:
    """SHA-256 of a constant's bytes, read without a device op (which would count as eager work)."""
    try:
        nbytes = value.numel() * value.element_size()
        if nbytes > MAX_HASHED_CONSTANT_BYTES or not value.is_contiguous():
            return None
        if value.device.type == "cpu":
            data = value.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            # Simulated device memory is host memory: the bytes are readable in place.
            data = ctypes.string_at(value.data_ptr(), nbytes) if nbytes else b""
        return hashlib.sha256(data).hexdigest()
    except Exception:  # a fake tensor or an exotic layout: keyed by shape and dtype only
        return None


def _canon(value: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    """A JSON-ready stand-in for a node argument that means the same in every process."""
    if isinstance(value, torch.fx.Node):
        return ["%", index[value]]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return ["float", repr(value)]  # keeps nan/inf, and 2.0 apart from 2
    if isinstance(value, list | tuple):
        return [_canon(v, index) for v in value]
    if isinstance(value, dict):
        return [[str(k), _canon(v, index)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    if isinstance(value, torch.device):
        return ["device", value.type]
    if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
        return str(value)
    if isinstance(value, slice):
        return ["slice", _canon(value.start, index), _canon(value.stop, index), _canon(value.step, index)]
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ["sym", str(value)]
    if isinstance(value, torch.Tensor):
        return _tensor(value, content=True)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)


def describe_graph(gm: torch.fx.GraphModule) -> list[Any]:
    """Every node of ``gm`` (and of the subgraphs it holds), canonically."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            nodes.append(["placeholder"])
            continue
        if node.op == "get_attr":
            try:
                attr = _attribute(gm, node.target)
            except AttributeError:
                attr = None
            if isinstance(attr, torch.fx.GraphModule):
                nodes.append(["get_attr", "graph", describe_graph(attr)])
            elif isinstance(attr, torch.Tensor):
                nodes.append(["get_attr", "tensor", _tensor(attr, content=True)])
            else:
                nodes.append(["get_attr", _canon(attr, index)])
            continue
        nodes.append([node.op, _target(node), _canon(node.args, index), _canon(node.kwargs, index)])
    return nodes


def describe_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Shapes, dtypes and strides of the graph's inputs (their values are not part of a NEFF)."""
    out = []
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            out.append(_tensor(value, content=False))
        elif isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            out.append(["sym", str(value)])
        else:
            out.append(["value", type(value).__name__])
    return out


def graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, kind: str, options: Mapping[str, Any]) -> str:
    """The cache key of one graph handed to the ``"neuron"`` compiler."""
    return digest(
        {
            "what": "graph",
            "kind": kind,
            "nodes": describe_graph(gm),
            "inputs": describe_inputs(example_inputs),
            "options": _canon(dict(options), {}),
            "versions": versions(),
            "compiler": keys.key_inputs(simulated=True),
        }
    )


def eager_key(signature: str, inputs: Mapping[str, Any] | None = None) -> str:
    """The cache key of one eager op signature, e.g. ``aten::mm(f32[4,4], f32[4,4])`` (``inputs``: the key inputs
    it was compiled with, default this process's)."""
    compiler = dict(inputs) if inputs is not None else keys.key_inputs(simulated=True)
    return digest({"what": "eager", "signature": signature, "versions": versions(), "compiler": compiler})
