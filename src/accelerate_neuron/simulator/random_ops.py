"""Random ops of the simulated device that must draw from the core's generator.

The CPU fallback hands an op's ``Generator?`` argument the current core's
generator, so ``bernoulli_``, ``rand``, ``randn``, ``normal_`` … on ``neuron``
follow ``torch.neuron.manual_seed`` / ``set_rng_state``. ``aten::native_dropout``
(what ``nn.Dropout`` runs on a PrivateUse1 tensor) has no generator argument:
the fallback would run the CPU kernel, which draws from the *CPU* default
generator. Dropout on the device would then not be reproducible from
``torch.neuron``'s RNG state, and a resumed run restoring that state would not
replay the same masks. A real Neuron core draws device randomness from its own
generator; this kernel makes the simulator do the same.
"""

from __future__ import annotations

import threading

import torch

from .runtime import state

_lock = threading.Lock()
_library: torch.library.Library | None = None


def _native_dropout(input: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    # Same contract as ATen's CPU kernel: a bool mask; ``train=False`` keeps the input.
    if input.numel() == 0:
        return input, torch.empty_like(input, dtype=torch.bool)
    if train is not None and not train:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    mask = torch.empty_like(input, dtype=torch.bool, memory_format=torch.contiguous_format)
    # The draw is the one eager signature this dropout costs (one op on Neuron);
    # the arithmetic around it is part of the same op, not separate eager work.
    mask.bernoulli_(keep)
    lib = state().lib
    lib.nsim_suspend_counting(1)
    try:
        return input.mul(mask).mul_(scale), mask
    finally:
        lib.nsim_suspend_counting(-1)


def register() -> None:
    """Register the neuron kernels above (idempotent)."""
    global _library
    with _lock:
        if _library is not None:
            return
        library = torch.library.Library("aten", "IMPL")
        library.impl("native_dropout", _native_dropout, "PrivateUse1")
        _library = library
