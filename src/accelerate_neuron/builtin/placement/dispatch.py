"""``device_map`` values on the loading and dispatch path: validate, keep ints, move, clean up.

- A core that is not visible (``{"": "neuron:7"}`` on 2 cores) is refused up
  front with the visible cores, instead of failing deep inside torch.
- safetensors accepts no string spelling of a Neuron device, only ints, so
  neuron values are turned into core indices before anything opens a file.
- Accelerate 1.15 ``dispatch_model`` no longer moves a single-device model
  when the device is an int and Neuron is available.
- ``dispatch_model`` adds ``model.neuron`` but ``remove_hook_from_module``
  does not know to remove it.
- Accelerate 1.16 hands safetensors ``"neuron:N"`` strings (its
  ``normalize_device``), which safetensors refuses.
- Transformers 4.57 ``caching_allocator_warmup`` allocates the whole model
  size on each accelerator, Neuron included (no reuse pool there: OOM risk).
- Transformers 5.25 ``kernelize`` (hub kernels, on by default once ``kernels``
  is installed) reads the execution device from ``device_map`` and cannot
  take an int (``int.type``), which is what this plugin keeps there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

from ... import device
from .auto import auto_max_memory
from .memory import visible_core

logger = logging.getLogger(__name__)


def normalise_device_map(device_map: Any, *, what: str = "device_map") -> Any:
    """``device_map`` with every Neuron value as a visible core index (a new dict if any changed).

    Raises :class:`PlacementError` for a core that is not visible. Non-dict
    values (strategy strings, None) come back unchanged.
    """
    if not isinstance(device_map, dict) or device.device_count() == 0:
        return device_map
    changed = {}
    for name, value in device_map.items():
        index = visible_core(value, what=f"{what}[{name!r}] =")
        if index is not None and (type(value) is not int or value != index):
            changed[name] = index
    if not changed:
        return device_map
    return {name: changed.get(name, value) for name, value in device_map.items()}


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """The call's arguments by name; None if they do not fit (upstream then reports it in its own words)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def wrap_device_map_argument(
    original: Callable[..., Any], *, what: str, auto_policy: bool = False, returns_map: bool = False
) -> Callable[..., Any]:
    """``original`` with its ``device_map`` argument validated and its Neuron values made ints.

    ``auto_policy``: ``device_map="auto"`` without ``max_memory`` uses the
    fewest cores that hold the model (see :mod:`.auto`). ``returns_map``:
    ``original`` returns the device map the load will carry out (Transformers'
    ``_get_device_map``), validated too: planning accepts cores this process
    cannot see, as upstream does; loading onto one is refused here.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(signature, args, kwargs)
        if bound is not None:
            given = bound.arguments["device_map"]
            normalised = normalise_device_map(given, what=what)
            changed = normalised is not given
            if changed:
                bound.arguments["device_map"] = normalised
            if auto_policy and given == "auto" and bound.arguments.get("max_memory") is None:
                limited = auto_max_memory(bound.arguments["model"])
                if limited is not None:
                    bound.arguments["max_memory"] = limited
                    changed = True
            if changed:
                args, kwargs = bound.args, bound.kwargs
        result = original(*args, **kwargs)
        if returns_map and isinstance(result, dict):
            result = normalise_device_map(result, what=f"{what} (planned from max_memory)")
        return result

    return wrapper


# --- safetensors as Accelerate calls it ------------------------------------------------------------


def wrap_safetensors_device(original: Callable[..., Any], *, position: int) -> Callable[..., Any]:
    """``safe_open`` / ``load_file`` with a Neuron ``device`` turned into its core index.

    Accelerate >= 1.16 spells integer devices as ``"neuron:N"`` before calling
    safetensors (``normalize_device``), which refuses every string spelling of
    a Neuron device. ``position`` is ``device``'s positional index.
    """

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            index = visible_core(kwargs["device"], what="safetensors device")
            if index is not None:
                kwargs["device"] = index
        elif len(args) > position:
            index = visible_core(args[position], what="safetensors device")
            if index is not None:
                args = (*args[:position], index, *args[position + 1 :])
        return original(*args, **kwargs)

    return wrapper


# --- dispatch_model -------------------------------------------------------------------------------


def dispatch_leaves_single_device_model(original: Callable[..., Any]) -> str | None:
    """``needed`` probe: None if ``dispatch_model(model, {"": 0})`` does not call ``model.to``.

    The probe module records ``.to`` instead of moving, so nothing touches the device.
    """
    import torch

    class _Probe(torch.nn.Module):
        def to(self, *args: Any, **kwargs: Any) -> _Probe:  # type: ignore[override]
            self.moved_to = (args, kwargs)
            return self

    probe = _Probe()
    original(probe, {"": 0})
    if getattr(probe, "moved_to", None) is not None:
        return "upstream dispatch_model already moves a single-device model to its device"
    return None


def wrap_dispatch_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch_model`` that refuses invisible cores and moves a single-core model onto its core."""
    import torch

    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch_model(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(signature, args, kwargs)
        if bound is None:
            return original(*args, **kwargs)
        device_map = bound.arguments["device_map"]
        normalise_device_map(device_map, what="dispatch_model device_map")  # validation only
        result = original(*args, **kwargs)
        devices = set(device_map.values()) if isinstance(device_map, dict) else set()
        if len(devices) == 1 and not bound.arguments.get("force_hooks"):
            index = device.core_index(next(iter(devices)))
            if index is not None:
                # what upstream did before the int-device branch lost its model.to(); the load
                # path leaves e.g. non-persistent buffers on CPU otherwise
                bound.arguments["model"].to(torch.device(device.DEVICE_TYPE, index))
        return result

    return dispatch_model


# --- _accelerate_added_attributes ----------------------------------------------------------------


def added_attributes_need_neuron(original: list[str]) -> str | None:
    if device.DEVICE_TYPE in original:
        return "upstream _accelerate_added_attributes already lists 'neuron'"
    return None


def add_neuron_attribute(original: list[str]) -> list[str]:
    return [*original, device.DEVICE_TYPE]


# --- caching_allocator_warmup ------------------------------------------------------------------------


def warmup_allocates_on_neuron(original: Callable[..., Any]) -> str | None:
    """``needed`` probe: None unless upstream's warmup already special-cases Neuron.

    Read from the source: running it would allocate on the device.
    """
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return None
    if re.search(r"""["']neuron["']""", source):
        return "upstream caching_allocator_warmup already skips Neuron devices"
    return None


def wrap_caching_allocator_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    """Warm up everything but Neuron cores: there is no reusable pool to warm and it may OOM."""

    @functools.wraps(original)
    def caching_allocator_warmup(model: Any, expanded_device_map: dict, hf_quantizer: Any) -> Any:
        kept = {k: v for k, v in expanded_device_map.items() if device.core_index(v) is None}
        return original(model, kept, hf_quantizer)

    return caching_allocator_warmup


# --- hub kernels ---------------------------------------------------------------------------------


def kernelize_reads_device_map(original: Callable[..., Any]) -> str | None:
    """``needed`` probe: None if upstream's ``kernelize`` takes the ``device_map`` it reads the device from."""
    if "device_map" not in inspect.signature(original).parameters:
        return "upstream kernelize takes no device_map (it asks the model for its device): nothing to correct"
    return None


def wrap_kernelize(original: Callable[..., Any]) -> Callable[..., Any]:
    """``kernelize`` with the core indices of ``device_map`` spelled as Neuron devices.

    Upstream takes the first non-CPU value of ``device_map`` as the execution
    device and asks it for ``.type``; the ints this plugin keeps on the loading
    path (safetensors refuses strings) have none. Only the copy handed to
    ``kernelize`` changes: the model's ``hf_device_map`` keeps the ints.
    """
    import torch

    signature = inspect.signature(original)

    @functools.wraps(original)
    def kernelize(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(signature, args, kwargs)
        device_map = bound.arguments.get("device_map") if bound is not None else None
        if bound is None or not isinstance(device_map, dict) or device.device_count() == 0:
            return original(*args, **kwargs)
        spelled = {
            name: torch.device(device.DEVICE_TYPE, value) if type(value) is int else value
            for name, value in device_map.items()
        }
        if spelled != device_map:
            bound.arguments["device_map"] = spelled
            return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)

    return kernelize
