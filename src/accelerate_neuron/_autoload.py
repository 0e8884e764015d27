"""``torch.backends`` entry point: runs at the end of ``import torch``.

It must never raise: PyTorch turns an exception here into a failed
``import torch`` for the user.
"""

from __future__ import annotations


def autoload() -> None:
    try:
        from .activation import activate

        activate("import torch (torch.backends entry point)")
    except BaseException:
        try:
            import logging

            logging.getLogger("accelerate_neuron").debug("accelerate_neuron autoload failed", exc_info=True)
        except BaseException:
            pass
