"""Transformers pipelines on Neuron cores.

``Pipeline.__init__`` turns an integer device into ``cuda:N``/``npu:N``/... and,
having no Neuron branch, into ``cpu`` on a Trainium host: ``device=0`` moves
the model to the CPU, and a model loaded with ``device_map`` (whose
``hf_device_map`` holds core indices) gets CPU inputs. Here an integer means
Neuron core N, as ``torch.device(N)`` does, and a model already on a core
stays there.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from ... import device
from .memory import visible_core


def _is_cpu_flag(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value < 0  # -1: upstream's "CPU / keep"


class _DropCpuDeviceNotice(logging.Filter):
    """Hides upstream's "Device set to use cpu" when the device is corrected to a core right after."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Device set to use cpu")


@contextlib.contextmanager
def _quiet_cpu_notice(module_name: str) -> Iterator[None]:
    upstream = logging.getLogger(module_name)
    notice = _DropCpuDeviceNotice()
    upstream.addFilter(notice)
    try:
        yield
    finally:
        upstream.removeFilter(notice)


def _first_core(hf_device_map: Any) -> int | None:
    """The core of ``hf_device_map``'s first entry if it is an int (upstream turns that int into cpu)."""
    if not hf_device_map:
        return None
    first = next(iter(hf_device_map.values()))
    if isinstance(first, bool) or not isinstance(first, int):
        return None
    return device.core_index(first)


def wrap_pipeline_init(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(*args: Any, **kwargs: Any) -> None:
        if device.device_count() == 0:
            original(*args, **kwargs)
            return
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # let upstream report the caller's mistake in its own words
            original(*args, **kwargs)
            return
        requested = bound.arguments.get("device")
        model = bound.arguments.get("model")
        hf_device_map = getattr(model, "hf_device_map", None)
        if requested is not None and not _is_cpu_flag(requested):
            index = visible_core(requested, what="pipeline device")
            if index is not None:
                bound.arguments["device"] = torch.device(device.DEVICE_TYPE, index)
        elif requested is None and hf_device_map is None:
            # upstream's default (0 -> no Neuron branch -> cpu) would pull a model off its core
            index = device.core_index(getattr(model, "device", None))
            if index is not None:
                bound.arguments["device"] = torch.device(device.DEVICE_TYPE, index)
        core = _first_core(hf_device_map) if requested is None else None
        if core is None:
            original(*bound.args, **bound.kwargs)
            return
        # a device cannot be passed with an hf_device_map (upstream raises): correct it afterwards
        with _quiet_cpu_notice(original.__module__):
            original(*bound.args, **bound.kwargs)
        pipe = bound.arguments[next(iter(signature.parameters))]
        if getattr(pipe, "device", None) == torch.device("cpu"):
            pipe.device = torch.device(device.DEVICE_TYPE, core)

    return __init__
