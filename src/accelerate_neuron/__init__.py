"""accelerate-neuron: stock Hugging Face code on AWS Trainium through the native PyTorch Neuron backend.

Installed, it activates on ``import torch`` (entry point group ``torch.backends``)
or on ``import accelerate_neuron``. On a machine without a Neuron device it
changes nothing.

Importing this package runs inside every ``import torch`` (the entry point lives in it), so at
module level it imports the standard library only: a broken dependency (pluggy, say) can make
activation fail, which is said once, never make ``import torch`` fail. ``hookimpl`` is looked up
when first used.
"""

from __future__ import annotations

import time as _time

_IMPORT_STARTED = _time.perf_counter()  # the entry point's cost includes this package's import

from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from .hookspecs import hookimpl
    from .status_report import Status

try:
    __version__ = version("accelerate-neuron")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "disable_bucketing",
    "hookimpl",
    "is_warming_up",
    "moe_stats",
    "padding_stats",
    "precompile",
    "reset_moe_stats",
    "reset_padding_stats",
    "reset_speculation_stats",
    "speculation_stats",
    "status",
]

_ENTRY_POINT = "import torch (torch.backends entry point)"


def __getattr__(name: str) -> Any:
    # ``from accelerate_neuron import hookimpl`` (third-party plugins): pluggy is imported here, not on import torch.
    if name == "hookimpl":
        from .hookspecs import hookimpl

        globals()["hookimpl"] = hookimpl
        return hookimpl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def status() -> Status:
    """What is active: the Neuron device, plugins, patches applied/skipped (and why)."""
    from .status_report import collect

    return collect()


def padding_stats() -> dict[str, dict[str, int]]:
    """Positions computed on Neuron, and how many were real, per call family since the process started.

    ``{"generate_prefill": {"computed": ..., "real": ...}, "generate_decode": ..., "forward": ..., "training": ...,
    "serving": ...}``: computed / real is what padding to buckets costs (1.0: none). See docs/generation.md.
    """
    from .padding import padding_stats as stats

    return stats()


def reset_padding_stats() -> None:
    """Zero :func:`padding_stats`."""
    from .padding import reset_padding_stats as reset

    reset()


def disable_bucketing(model: Any, disabled: bool = True) -> Any:
    """Run ``model``'s inference calls as upstream does: no length or batch buckets, no compiled forward.

    ``disabled=False`` undoes it. Returns the model. For every model of the process, set
    ``ACCELERATE_NEURON_BUCKET_FORWARDS=0``.
    """
    from .builtin.inference.call import disable

    return disable(model, disabled)


def moe_stats(model: Any = None) -> dict[str, Any]:
    """What mixture-of-experts layers computed on Neuron since the process started (or :func:`reset_moe_stats`).

    ``shapes``: per call shape, the implementation that ran (``blockwise``, ``gathered``, ``dense``, ...), tokens,
    ``top_k``, experts, rows multiplied, ``ratio`` (the experts' FLOPs over a sparse dispatch's), FLOPs per token,
    eager ``calls`` and whether a compiled graph holds it (``compiled``: counted once, when traced). With
    ``model``: also ``dropped_pairs``, the pairs its experts dropped in their last call (capacity mode only,
    ``ACCELERATE_NEURON_MOE_CAPACITY_FACTOR``).
    """
    from . import moe_accounting as stats

    snapshot = stats.snapshot()
    if model is not None:
        snapshot["dropped_pairs"] = stats.dropped_pairs(model)
    return snapshot


def reset_moe_stats() -> None:
    """Forget the MoE calls :func:`moe_stats` reports."""
    from . import moe_accounting as stats

    stats.reset()


def speculation_stats() -> dict[str, float]:
    """What speculative ``generate()`` calls on Neuron paid off since the process started (or
    :func:`reset_speculation_stats`): ``calls``, ``target_forwards``, ``draft_forwards``, ``candidates`` proposed,
    ``accepted``, ``tokens`` generated, ``accepted_per_forward`` and ``forwards_per_token`` (below 1: speculation
    saves target forwards)."""
    from . import speculation_accounting as stats

    return stats.snapshot()


def reset_speculation_stats() -> None:
    """Forget the speculative calls :func:`speculation_stats` reports."""
    from . import speculation_accounting as stats

    stats.reset()


def precompile(target: Any, **options: Any) -> dict[str, Any]:
    """Fill the NEFF cache for ``target`` in this process: a model's ``generate()`` shapes, or a ``Trainer``'s.

    ``precompile(model, prompt_lengths=[32, 100], batch_sizes=[1, 4], max_new_tokens=64, **generate_kwargs)``
    warms one prefill and one decode step per (prompt bucket, batch bucket, cache bucket) those calls reach;
    ``precompile(trainer)`` runs the Trainer's own steps on one batch per length bucket, weights kept. Returns
    the shapes found and warmed; on the simulated device also the graphs and eager signatures compiled now
    and already cached, and the Trainium compile time paid now (cost model). The same warm-up as
    ``accelerate-neuron precompile -- CMD``, with one worker.
    """
    from .builtin.warmup.api import precompile as warm

    counter = _simulator_counts()
    before = counter() if counter else None
    report = warm(target, **options)
    if counter and before is not None:
        from . import costs

        after = counter()
        delta = {k: after[k] - before[k] for k in after}
        report.update(delta)
        report["estimate"] = costs.estimate(delta["graphs_compiled"], delta["eager_compiled"])
    return report


def is_warming_up() -> bool:
    """Whether this process runs as a warm-up: an ``accelerate-neuron precompile`` worker, or inside ``precompile()``.

    ``generate()`` then returns stand-ins (the prompt, then pad tokens): a script skips its own side
    effects (writing results, sending them) with ``if not accelerate_neuron.is_warming_up(): ...``.
    """
    from .builtin import precompile_session as session

    return session.current() is not None


def _simulator_counts() -> Any:
    from . import simulator

    if not simulator.is_installed():
        return None

    def counts() -> dict[str, int]:
        st = simulator.stats()
        return {
            "graphs_compiled": st["compiles"],
            "graphs_cached": st["compile_cache_hits"],
            "eager_compiled": st["eager_compiles"],
            "eager_cached": st["eager_cache_hits"],
        }

    return counts


def _activate_on_import() -> None:
    try:
        import sys

        from .activation import activate

        torch = sys.modules.get("torch")
        in_torch_import = torch is not None and getattr(getattr(torch, "__spec__", None), "_initializing", False)
        state = activate(_ENTRY_POINT if in_torch_import else "import accelerate_neuron")
        state.seconds = _time.perf_counter() - _IMPORT_STARTED
    except BaseException as exc:  # never break an import (not even with SystemExit from a broken dependency)
        if isinstance(exc, KeyboardInterrupt):
            raise
        from ._autoload import said_once

        said_once(exc)


_activate_on_import()
