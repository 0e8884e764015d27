"""accelerate-neuron: stock Hugging Face code on AWS Trainium through the native PyTorch Neuron backend.

Installed, it activates on ``import torch`` (entry point group ``torch.backends``)
or on ``import accelerate_neuron``. On a machine without a Neuron device it
changes nothing.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .hookspecs import hookimpl

try:
    __version__ = version("accelerate-neuron")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl", "status"]


def status():  # noqa: ANN201 - returns accelerate_neuron.status.Status
    """What is active: the Neuron device, plugins, patches applied/skipped (and why)."""
    from .status import collect

    return collect()


def _activate_on_import() -> None:
    try:
        import sys

        from .activation import activate

        torch = sys.modules.get("torch")
        during_torch_import = torch is not None and getattr(getattr(torch, "__spec__", None), "_initializing", False)
        activate("import torch (torch.backends entry point)" if during_torch_import else "import accelerate_neuron")
    except Exception:  # never break an import
        pass


_activate_on_import()
