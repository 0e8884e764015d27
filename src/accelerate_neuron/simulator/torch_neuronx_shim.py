"""Stand-in for the ``torch_neuronx`` package while the simulated device is installed.

Upstream libraries gate their Neuron support on
``importlib.util.find_spec("torch_neuronx")`` and sometimes ``import torch_neuronx``;
on a real host that package registers the device. Here the device is already
registered by the simulator, so importing this module registers nothing; it
offers the backend's own metrics functions (``get_dynamo_metrics``,
``get_fallback_ops``, ``metrics.get_counter_value``, ...: :mod:`.backend_api`).
It is served only when no real torch-neuronx is importable.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__version__ = "0+simulated"
SIMULATED = True

_NAME = "torch_neuronx"


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(_NAME)
        module.__version__ = __version__
        module.SIMULATED = True
        module.__doc__ = __doc__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        from . import backend_api

        backend_api.attach(module)
        sys.modules[f"{_NAME}.metrics"] = module.metrics  # `import torch_neuronx.metrics` works too


class ShimFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_neuronx`` as the simulator's stand-in."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME:
            return None
        return importlib.machinery.ModuleSpec(_NAME, _ShimLoader(), origin="accelerate_neuron simulator")


def install_finder() -> None:
    """Serve ``torch_neuronx`` ahead of an unusable installed one (e.g. PyPI's placeholder)."""
    if not any(isinstance(f, ShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, ShimFinder())
    loaded = sys.modules.get(_NAME)
    if loaded is not None and not getattr(loaded, "SIMULATED", False):
        del sys.modules[_NAME]
        sys.modules.pop(f"{_NAME}.metrics", None)


def is_shim(module: types.ModuleType | None) -> bool:
    return bool(module is not None and getattr(module, "SIMULATED", False))
