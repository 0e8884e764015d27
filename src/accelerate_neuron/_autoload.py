"""``torch.backends`` entry point: runs at the end of ``import torch``.

It must never raise: PyTorch turns an exception here into a failed ``import torch`` for the user
("Failed to load the backend extension"). Loading it imports the package's ``__init__`` first, which
imports only the standard library at module level; everything of ours is imported inside the guard
below (and the one in ``__init__``), so a broken dependency costs the Neuron patches, said once on
stderr, never the user's ``import torch``.
"""

from __future__ import annotations

_said = False


def said_once(exc: BaseException) -> None:
    """Log, once per process, that activation failed and ``import torch`` goes on without the plugin."""
    global _said
    if _said:
        return
    _said = True
    try:
        import logging

        logging.getLogger("accelerate_neuron").warning(
            "accelerate_neuron: not activated (%s: %s); import torch goes on without the Neuron plugin",
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            exc_info=logging.getLogger("accelerate_neuron").isEnabledFor(logging.DEBUG),
        )
    except BaseException:
        pass


def autoload() -> None:
    try:
        from .activation import activate

        activate("import torch (torch.backends entry point)")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        said_once(exc)
