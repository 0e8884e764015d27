"""Where a model's weights are, and moving nested values to a device: asked by every capability alike."""

from __future__ import annotations

import copy
from typing import Any

import torch

from .. import device as neuron_device


def model_device(model: Any) -> torch.device | None:
    """The Neuron device holding ``model`` (its ``device``, else its first parameter's), or None if not on Neuron."""
    try:
        dev = model.device
    except Exception:  # no parameters, or a module without the property
        dev = None
    if not isinstance(dev, torch.device):
        try:
            dev = next(model.parameters()).device
        except Exception:
            return None
    return dev if dev.type == neuron_device.DEVICE_TYPE else None


def split_across_devices(model: Any) -> bool:
    """Whether ``model`` was dispatched over several devices (Accelerate's ``hf_device_map``)."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict):
        return False
    return len({str(d) for d in device_map.values() if str(d) not in ("cpu", "disk")}) > 1


def move(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor (also nested in dicts, lists, tuples) on ``device``.

    Containers are rebuilt only if something moved, so ``ModelOutput`` and
    ``Cache`` objects keep their identity (caches are never moved: they live
    on the model's device by construction).
    """
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        moved = {k: move(v, device) for k, v in value.items()}
        if all(moved[k] is value[k] for k in moved):
            return value
        if type(value) is dict:
            return moved
        out = copy.copy(value)
        for k, v in moved.items():
            out[k] = v
        return out
    if isinstance(value, list | tuple):
        items = [move(v, device) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    return value
