"""How much ``device_map`` planning may put on each Neuron core, and the user's ``max_memory``.

Accelerate's ``get_max_memory`` enumerates CUDA/NPU/XPU/... but not Neuron, so
on a Trainium host ``device_map="auto"`` plans for the CPU only. The
replacement here enumerates the visible cores (budget: the
``neuron_memory_budget`` hook) and validates a user's ``max_memory``, keeping
Accelerate's contract: string sizes are converted in the caller's dict in
place (Transformers later compares the caller's values with ``min()``).
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

from ... import device, logs
from ...plugins import call_hook

logger = logging.getLogger(__name__)

HOST_KEYS = ("cpu", "disk")


class PlacementError(ValueError):
    """A ``device_map`` / ``max_memory`` value that names no visible Neuron core or no valid size."""


def describe_visible(cores: int | None = None) -> str:
    """``"this process sees 2 Neuron core(s): 0, 1"`` (+ NEURON_RT_VISIBLE_CORES when set)."""
    count = device.device_count() if cores is None else cores
    listed = ", ".join(str(i) for i in range(count)) if count else "none"
    text = f"this process sees {count} Neuron core(s): {listed}"
    env = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if env:
        text += f" (NEURON_RT_VISIBLE_CORES={env})"
    return text


def visible_core(value: Any, *, what: str, cores: int | None = None) -> int | None:
    """The visible core index ``value`` names; None if it names no Neuron core; raises if not visible."""
    index = device.core_index(value)
    if index is None:
        return None
    count = device.device_count() if cores is None else cores
    if not 0 <= index < count:
        raise PlacementError(
            f"{what} {value!r} names Neuron core {index}, which is not visible: {describe_visible(count)}. "
            f"Use an index in 0..{count - 1} (or 'neuron:0'..'neuron:{count - 1}'), 'cpu' or 'disk'."
        )
    return index


def default_budget(total_memory: int, reserved: int, free: int | None) -> int:
    """The built-in per-core budget: ``mem_get_info``'s free bytes, else ``total - reserved``."""
    return max(0, int(free) if free is not None else int(total_memory) - int(reserved))


def core_budget(index: int) -> int:
    """Bytes planning may place on core ``index``, asked through the ``neuron_memory_budget`` hook."""
    memory = device.core_memory(index)
    free = memory.free if memory.source == "mem_get_info" else None
    fallback = default_budget(memory.total, memory.reserved, free)
    answer = call_hook(
        "neuron_memory_budget", index=index, total_memory=memory.total, reserved=memory.reserved, free=free
    )
    if answer is None:
        return fallback
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or answer < 0:
        logs.once(
            logger,
            "placement.budget",
            "accelerate_neuron: a neuron_memory_budget hook returned %r for core %d; expected bytes >= 0. "
            "Using the built-in budget (free memory) instead; fix the plugin's hook.",
            answer,
            index,
        )
        return fallback
    return int(answer)


def _convert_size(key: Any, value: Any) -> int | float:
    from accelerate.utils.modeling import convert_file_size_to_int

    if isinstance(value, str):
        try:
            value = convert_file_size_to_int(value)
        except ValueError:
            raise PlacementError(
                f"max_memory[{key!r}] = {value!r} is not a size: use bytes (an int) or a string with a unit "
                f"such as '20GiB' or '500MB'."
            ) from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlacementError(
            f"max_memory[{key!r}] = {value!r} is not a size: use bytes (an int) or a string such as '20GiB'."
        )
    if value < 0:
        raise PlacementError(f"max_memory[{key!r}] = {value!r} is negative: sizes must be >= 0 bytes.")
    return value


def _core_key(key: Any, cores: int) -> int:
    if isinstance(key, str) and key.strip().lower() == device.DEVICE_TYPE:
        raise PlacementError(
            f"max_memory key {key!r} does not say which core: use 'neuron:N' or the index N "
            f"({describe_visible(cores)})."
        )
    index = device.core_index(key)
    if index is None:
        raise PlacementError(
            f"max_memory key {key!r} is not recognised on this Neuron host: use core indices "
            f"0..{cores - 1} (or 'neuron:0'..'neuron:{cores - 1}'), 'cpu' and 'disk' ({describe_visible(cores)})."
        )
    if not 0 <= index < cores:
        # Planning only converts sizes, as upstream's get_max_memory does for a GPU it cannot see (it warns
        # too): a plan may be made for another host. Carrying out a plan that uses the core raises.
        logs.once(
            logger,
            ("placement.invisible_core", index),
            "accelerate_neuron: max_memory key %r names Neuron core %d, which is not visible (%s); planning "
            "goes on, but placing anything there will fail.",
            key,
            index,
            describe_visible(cores),
        )
    return index


def normalise_max_memory(max_memory: dict[Any, Any], cores: int) -> dict[int | str, int | float]:
    """Validate a user's ``max_memory``; return ``{core: bytes, ..., "cpu": ..., "disk": ...}``.

    String sizes are converted in ``max_memory`` itself, as Accelerate does.
    """
    found: dict[int, int | float] = {}
    host: dict[str, int | float] = {}
    for key in list(max_memory):
        size = _convert_size(key, max_memory[key])
        if isinstance(max_memory[key], str):
            max_memory[key] = size  # Accelerate's contract: Transformers min()s the caller's values later
        if isinstance(key, str) and key in HOST_KEYS:
            host[key] = size
            continue
        index = _core_key(key, cores)
        if index in found:
            raise PlacementError(f"max_memory names Neuron core {index} twice (key {key!r}); give each core once.")
        found[index] = size
    ordered: dict[int | str, int | float] = dict(sorted(found.items()))
    ordered.update((k, host[k]) for k in HOST_KEYS if k in host)
    return ordered


def wrap_get_max_memory(original: Callable[..., dict]) -> Callable[..., dict]:
    """Accelerate's ``get_max_memory`` that also enumerates (and validates) Neuron cores."""

    @functools.wraps(original)
    def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict:
        cores = device.device_count()
        if cores == 0:
            return original(max_memory)
        if max_memory is None:
            found: dict[int | str, int | float] = {}
            for index in range(cores):
                try:
                    found[index] = core_budget(index)
                except Exception as exc:  # like upstream for a GPU that fails to answer: plan without it
                    logger.warning("accelerate_neuron: Neuron core %d left out of device_map planning: %s", index, exc)
            # Upstream's own answer is not asked: Accelerate >= 1.16 would allocate on every core to
            # probe it and fail on the missing mem_get_info. The host entry is upstream's rule.
            import psutil

            found["cpu"] = psutil.virtual_memory().available
            return found
        return normalise_max_memory(max_memory, cores)

    return get_max_memory


def upstream_reads_neuron_memory(original: Callable[..., dict]) -> str | None:
    """``needed`` probe of the ``get_max_memory`` patch: a reason to stand aside, or None.

    Upstream plans for Neuron by itself once both hold:

    - its ``get_max_memory`` enumerates the Neuron cores (Accelerate >= 1.16 enumerates any accelerator
      through ``get_torch_accelerator_backend`` and asks ``get_accelerator_free_memory``);
    - the device module it asks can say how much is free: ``torch.neuron.mem_get_info`` exists (newer SDKs;
      2.33 builds lack it). Through ``torch.accelerator`` instead, only an initialised runtime can tell
      whether ``get_memory_info`` works for Neuron, so the patch then stays.

    A copy of ``original`` runs with a ``get_accelerator_free_memory`` that only notes which module it
    was handed, and without its probe allocation on each core: nothing is allocated and the runtime is
    not started (a torchrun rank must not touch its core before ``init_process_group``).
    """
    import torch

    module = device.neuron_module()
    cores = device.device_count()
    if module is None or cores == 0 or "get_accelerator_free_memory" not in original.__code__.co_names:
        return None  # upstream does not ask a device module for free memory here (e.g. Accelerate 1.10)
    asked: list[Any] = []

    def noted(device_module: Any, index: int) -> int:
        asked.append(device_module)
        return 1

    class _NoAllocation:  # upstream's `torch.tensor(0, device=...)` probe is skipped; all else is torch
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def tensor(*args: Any, **kwargs: Any) -> None:
            return None

    probe = types.FunctionType(
        original.__code__,
        {**original.__globals__, "get_accelerator_free_memory": noted, "torch": _NoAllocation()},
        original.__name__,
        original.__defaults__,
        original.__closure__,
    )
    planned = probe(None)
    if sorted(k for k in planned if isinstance(k, int)) != list(range(cores)) or not asked:
        return None
    if all(m is module for m in asked) and callable(getattr(module, "mem_get_info", None)):
        return (
            "upstream get_max_memory enumerates the Neuron cores and torch.neuron.mem_get_info reports their free "
            "memory: stock device_map planning works (the neuron_memory_budget hook is not consulted)"
        )
    return None


# --- balancing (Accelerate releases whose get_balanced_memory counts only "cuda"-typed devices) ---


def balances_int_devices(original: Callable[..., dict]) -> str | None:
    """``needed`` probe: None if ``original`` ignores integer (accelerator index) devices.

    Runs a copy of ``original`` whose ``get_max_memory`` is the identity, on a
    meta-device model, with two int devices: a release that counts them lowers
    device 0's share; one that does not returns the dict unchanged. Nothing is
    allocated and the Neuron runtime is not touched.
    """
    import torch

    probe = types.FunctionType(
        original.__code__,
        {**original.__globals__, "get_max_memory": lambda max_memory=None: dict(max_memory)},
        original.__name__,
        original.__defaults__,
        original.__closure__,
    )
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    big = 10**12
    result = probe(model, max_memory={0: big, 1: big, "cpu": big})
    if result[0] < big:
        return "upstream get_balanced_memory already balances integer (accelerator index) devices"
    return None


def _split_buffer(model: Any, sizes: Mapping[str, int], no_split: list[str]) -> int:
    """Slack added to each core's share, sized as Accelerate sizes it for GPUs.

    An even split leaves each device slightly short of whole layers, so the
    last layers would spill; the slack is 1.25x the bigger of the largest
    no-split block and the mean size of the innermost modules.
    """
    from accelerate.utils.modeling import get_module_leaves

    block = 0
    if no_split:
        for name, module in model.named_modules():
            if name and type(module).__name__ in no_split:
                block = max(block, sizes.get(name, 0))
    parameters = set(get_module_leaves(sizes))
    modules = {n: s for n, s in sizes.items() if n not in parameters}
    inner = [modules[n] for n in get_module_leaves(modules)]
    mean = int(sum(inner) / max(len(inner), 1))
    return int(1.25 * max(block, mean))


def wrap_get_balanced_memory(original: Callable[..., dict]) -> Callable[..., dict]:
    """``get_balanced_memory`` that spreads a model over Neuron cores like over GPUs."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_balanced_memory(*args: Any, **kwargs: Any) -> dict:
        if device.device_count() == 0:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # let upstream report the caller's mistake in its own words
            return original(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        model, low_zero = a["model"], bool(a.get("low_zero"))
        user_set = a.get("max_memory") is not None
        from accelerate.utils import modeling

        memory = modeling.get_max_memory(a.get("max_memory"))
        cores = sorted(k for k, v in memory.items() if isinstance(k, int) and v > 0)
        if not cores:
            return memory
        if len(cores) == 1:
            low_zero = False  # nothing to move off core 0 onto
            if not user_set:
                memory[cores[0]] *= 0.9  # keep 10% for activations, as upstream does on GPUs
        no_split = a.get("no_split_module_classes") or []
        if not isinstance(no_split, (list, tuple, set)):
            no_split = [no_split]
        sizes = modeling.compute_module_sizes(model, dtype=a.get("dtype"), special_dtypes=a.get("special_dtypes"))
        share = sizes[""] // (len(cores) - 1 if low_zero else len(cores))
        share += _split_buffer(model, sizes, list(no_split))
        for index in cores[:-1]:  # the last core keeps its full budget in case the slack is short
            memory[index] = min(memory[0] if low_zero and index == 0 else share, memory[index])
        if low_zero and 0 in memory:
            others = sum(memory[i] for i in cores if i != 0)
            memory[0] = min(max(0, sizes[""] - others), memory[0])
        return memory

    return get_balanced_memory
