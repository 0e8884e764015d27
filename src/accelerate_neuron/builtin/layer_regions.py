"""Which layers are a model's regions, and their compiled forwards, installed for the duration of one call.

Shared by the plugins whose calls compile per layer (``generate()``, bucketed
inference calls); the ``regions`` plugin answers whether and how regions compile
(``neuron_compile_config(purpose="region")``: no answer turns them off).

A region is one decoder layer: the block Transformers never splits across
devices (``_no_split_modules``), so it always sits on one core with all its
weights. Per layer rather than per core's run of layers because every layer has
the same code and shapes: one graph per shape serves every layer on every core,
and how ``device_map`` cuts the model never changes which graphs exist.

The compiled forward is installed on each layer instance inside
:func:`compiled_layers` and removed after it (a model must stay copyable and
picklable, and code outside the call, a training step above all, must see the
plain layer). It runs compiled only when nothing compiles the whole call
already (``torch.compiler.is_compiling()``: a whole-model graph traces the plain
forward, so nothing is compiled twice) and without gradients.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import device as neuron_device
from .. import logs, settings
from ..plugins import call_hook
from . import overrides
from .compile_options import compile_options
from .shapes import make_room_for_buckets

logger = logging.getLogger(__name__)

#: Set on a layer's installed forward, so a second call on the same model shares it.
_REGION_FLAG = "_accelerate_neuron_region"
#: One compiled function per plain function (a layer class's ``forward``): identical layers share it.
_compiled: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]] = weakref.WeakKeyDictionary()


def compile_settings() -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments from ``neuron_compile_config(purpose="region")``; None: no answer."""
    answer = call_hook("neuron_compile_config", purpose="region")
    return None if answer is None else compile_options(answer, "region")


def neuron_cores(model: Any) -> set[str]:
    """The Neuron devices holding ``model``'s weights (Accelerate's ``hf_device_map`` when there is one)."""
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and device_map:
        places = {str(d) for d in device_map.values()}
        if all(p not in ("cpu", "disk") for p in places):
            return {f"{neuron_device.DEVICE_TYPE}:{p}" if p.isdigit() else p for p in places}
    return {str(p.device) for p in model.parameters() if p.device.type == neuron_device.DEVICE_TYPE}


def mode_for(model: Any) -> str:
    """``"layers"`` (compile per decoder layer) or ``"off"`` for a call of ``model`` on Neuron.

    ``auto`` means layers when the model spans several cores (a whole-model graph cannot run there) and the
    whole model on one core, where one graph per step is one program launch instead of one per layer.
    """
    if compile_settings() is None:
        return "off"  # the plugin is disabled, or a third party said no
    mode = settings.get("compile_regions")
    if mode == "auto":
        return "layers" if len(neuron_cores(model)) > 1 else "off"
    return mode


def enabled(model: Any) -> bool:
    """Whether calls of ``model`` compile its decoder layers one by one: mode ``layers`` and layers found."""
    return mode_for(model) == "layers" and bool(blocks(model))


def blocks(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks, outermost first in module order: instances of its ``_no_split_modules``.

    Without that list (a model Transformers cannot dispatch itself), the longest ``ModuleList`` of modules of
    one class. A block inside another block is part of the outer one's region.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in names:
                found.append(child)
            else:
                visit(child)

    if names:
        visit(model)
    if not found:
        lists = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1
        ]
        if lists:
            found = list(max(lists, key=len))
    return found


def _shared(function: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    compiled = _compiled.get(function)
    if compiled is None:
        compiled = _compiled[function] = torch.compile(function, **options)
    return compiled


def _region_forward(layer: torch.nn.Module, inner: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``layer``'s forward, compiled through the function its class shares when ``inner`` is its own method."""
    function = getattr(inner, "__func__", None)
    if function is not None and getattr(inner, "__self__", None) is layer:
        shared = _shared(function, options)

        def run(*args: Any, **kwargs: Any) -> Any:
            return shared(layer, *args, **kwargs)
    else:  # wrapped by someone else: compiled as it is (still one NEFF per shape: the graphs are the same)
        run = _shared(inner, options)

    def region(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return inner(*args, **kwargs)  # traced by a whole-model graph, or training: the plain layer
        return run(*args, **kwargs)

    return region


def _attribute(layer: torch.nn.Module) -> str:
    """Where the layer's own forward is: under Accelerate's hook (``_old_forward``) or ``forward`` itself."""
    return "_old_forward" if "_old_forward" in layer.__dict__ else "forward"


@contextlib.contextmanager
def compiled_layers(model: Any) -> Iterator[list[torch.nn.Module]]:
    """Inside the block, ``model``'s decoder layers run compiled one by one (no gradients, not under a trace)."""
    options = compile_settings()
    layers = blocks(model) if options is not None else []
    if not layers:
        yield []
        return
    make_room_for_buckets("every decoder layer and shape is a graph of the layer's function", len(layers))
    with contextlib.ExitStack() as stack:
        for layer in layers:
            build = functools.partial(_region_forward, layer, options=options)
            stack.enter_context(overrides.overridden(layer, _attribute(layer), _REGION_FLAG, build))
        _announce(model, layers)
        yield layers


def _announce(model: Any, layers: list[torch.nn.Module]) -> None:
    cores = sorted(neuron_cores(model))
    logs.once(
        logger,
        ("regions.layers", type(model).__name__, len(layers), len(cores)),
        "accelerate_neuron: %s runs compiled one decoder layer at a time (%d %s layers on %d Neuron core(s): %s); "
        "identical layers share one graph per shape, and embeddings, final norm and head run eagerly. %s=off turns "
        "this off.",
        type(model).__name__,
        len(layers),
        "/".join(sorted({type(x).__name__ for x in layers})),
        len(cores),
        ", ".join(cores),
        settings.env_name("compile_regions"),
    )
