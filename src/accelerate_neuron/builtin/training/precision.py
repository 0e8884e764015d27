"""fp16 training on Neuron: refused with one message naming bf16, wherever it is asked for.

Where it can be asked for: ``TrainingArguments(fp16=True)``, ``Accelerator(mixed_precision="fp16")``, and
``ACCELERATE_MIXED_PRECISION=fp16``, which ``accelerate launch`` sets in every process from
``mixed_precision: fp16`` in its config file or ``--mixed_precision fp16``.

Why refused, from TorchNeuron's public documentation (torch-neuronx 2.13.3 / 2.14.3, Neuron SDK 2.33):
its autocast follows PyTorch's CUDA conventions and ``torch.neuron.get_amp_supported_dtype()`` lists
``float16``, so fp16 *autocast* exists; but nothing public documents a gradient scaler on Neuron
(``torch.amp.GradScaler("neuron")`` and the ``_amp_foreach_non_finite_check_and_unscale_`` /
``_amp_update_scale_`` kernels it runs), and AWS names bf16 as the type to train in on Trainium. fp16
training is autocast *and* a scaler (fp16 gradients underflow without one); bf16 needs no scaler. Until a
scaler is documented, fp16 stops with this message instead of failing or training unscaled.

Upstream: Accelerate 1.10 refuses it with a message that does not mention bf16 ("fp16 mixed precision
requires a GPU (not 'neuron')"); 1.16 accepts it because ``get_amp_supported_dtype`` lists float16, and
builds a ``GradScaler`` for the neuron device. The simulated device runs those kernels on the CPU, so it
cannot tell whether they exist on Trainium.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace
from typing import Any

LAUNCH_ENV = "ACCELERATE_MIXED_PRECISION"


def refusal(what: str) -> str:
    """The one message for every way fp16 training is asked for; ``what`` says how it was asked."""
    return (
        f"{what}: fp16 training is not supported on Neuron. Train in bf16, the NeuronCore's native training type, "
        "which needs no gradient scaler: TrainingArguments(bf16=True) (bf16_full_eval=True for evaluation), "
        "Accelerator(mixed_precision='bf16'), `mixed_precision: bf16` in the Accelerate config or "
        "`accelerate launch --mixed_precision bf16`; or train on the CPU (use_cpu=True / cpu=True). "
        "(TorchNeuron documents fp16 autocast but no gradient scaler, which fp16 training needs.)"
    )


def check_training_arguments(args: Any) -> None:
    """``TrainingArguments(fp16=True)`` / ``fp16_full_eval=True`` on Neuron: refused."""
    chosen = [name for name in ("fp16", "fp16_full_eval") if getattr(args, name, False)]
    if chosen:
        raise ValueError(refusal(" and ".join(f"{name}=True" for name in chosen)))


def _requested(original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, bool]:
    """(how fp16 was asked for, or None; whether ``cpu=True``) of an ``Accelerator(...)`` call."""
    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    except TypeError:  # upstream raises its own error for a bad call
        return None, False
    cpu = bool(bound.get("cpu"))
    chosen = bound.get("mixed_precision")
    if chosen is not None:
        value = getattr(chosen, "value", chosen)
        return (f"Accelerator(mixed_precision={value!r})" if str(value).lower() == "fp16" else None), cpu
    if os.environ.get(LAUNCH_ENV, "").strip().lower() == "fp16":
        return (
            f"{LAUNCH_ENV}=fp16 (`accelerate launch` sets it from `mixed_precision: fp16` in its config file or "
            "--mixed_precision fp16)"
        ), cpu
    return None, cpu


def wrap_accelerator_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from .args import targets_neuron  # (args imports this module)

        what, cpu = _requested(original, (self, *args), kwargs)
        if what is not None and targets_neuron(SimpleNamespace(use_cpu=cpu)):
            raise ValueError(refusal(what))
        original(self, *args, **kwargs)

    return __init__
