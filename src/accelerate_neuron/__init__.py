"""accelerate-neuron: stock Hugging Face code on AWS Trainium through the native PyTorch Neuron backend.

Installed, it activates on ``import torch`` (entry point group ``torch.backends``)
or on ``import accelerate_neuron``. On a machine without a Neuron device it
changes nothing.
"""

from __future__ import annotations

import time as _time

_IMPORT_STARTED = _time.perf_counter()  # the entry point's cost includes this package's import

from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from .hookspecs import hookimpl  # noqa: E402

if TYPE_CHECKING:
    from .status_report import Status

try:
    __version__ = version("accelerate-neuron")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl", "status"]

_ENTRY_POINT = "import torch (torch.backends entry point)"


def status() -> Status:
    """What is active: the Neuron device, plugins, patches applied/skipped (and why)."""
    from .status_report import collect

    return collect()


def _activate_on_import() -> None:
    try:
        import sys

        from .activation import activate

        torch = sys.modules.get("torch")
        in_torch_import = torch is not None and getattr(getattr(torch, "__spec__", None), "_initializing", False)
        state = activate(_ENTRY_POINT if in_torch_import else "import accelerate_neuron")
        state.seconds = _time.perf_counter() - _IMPORT_STARTED
    except Exception:  # never break an import
        pass


_activate_on_import()
