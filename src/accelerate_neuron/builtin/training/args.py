"""``TrainingArguments`` on Neuron: device, bf16, fp16 refusal, compile backend, drop_last.

What each Transformers release lacks (read from their sources):

- 4.x picks ``cpu`` when no CUDA is present (no Neuron branch in
  ``_setup_devices``) and refuses ``bf16=True`` ("Your setup doesn't support
  bf16/gpu") because ``is_torch_bf16_gpu_available`` knows no Neuron.
- 4.x defaults ``torch_compile_backend`` to ``"inductor"``; 5.x picks ``"neuron"``.
- No release refuses ``fp16=True`` early: Accelerate <= 1.15 fails later, deep
  inside ``Accelerator.__init__``, with a message that does not mention bf16;
  1.16 accepts it (see :mod:`.precision` for why it is refused here).
- No release makes the last batch static (``dataloader_drop_last``).

A user's explicit choice always wins. To know which fields were passed
explicitly (their values may equal the defaults), the ``__init__`` of
``TrainingArguments`` and ``Seq2SeqTrainingArguments`` records the call's
argument names. Other subclasses (TRL configs) have their own generated
``__init__`` that does not call the base one, and argument parsers pass every
field: there, only a value other than the field's default counts as chosen.
(``__new__``, inherited by all subclasses, would see every call, but CPython
cannot restore a class's ``object.__new__`` once replaced, so it could not be
reverted.)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any

from ... import device, logs
from ..engines import forced_torch_device
from . import precision
from .compile_config import train_compile_config

logger = logging.getLogger(__name__)

EXPLICIT_ATTR = "_accelerate_neuron_explicit"
DROP_LAST_ATTR = "_accelerate_neuron_drop_last"
_TRUE = ("1", "true", "yes", "on", "y", "t")


# ------------------------------------------------------------ explicit fields


def _init_fields(cls: type) -> dict[str, Any]:
    """Init field name -> default (``dataclasses.MISSING`` for factories/required)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def _explicit_names(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[str]:
    fields = _init_fields(cls)
    names = list(fields)
    passed = dict(zip(names, args, strict=False))
    passed.update({k: v for k, v in kwargs.items() if k in fields})
    if len(passed) >= 0.9 * len(fields):
        # A parser (HfArgumentParser) or dataclasses.replace() passes every field:
        # only a value other than the default can be told apart as a choice.
        return frozenset(k for k, v in passed.items() if fields[k] is dataclasses.MISSING or not _same(v, fields[k]))
    return frozenset(passed)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def explicit_fields(args: Any) -> frozenset[str] | None:
    """Names of the fields the user passed to ``args`` (None if unknown)."""
    return getattr(args, "__dict__", {}).get(EXPLICIT_ATTR)


def wrap_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self.__dict__[EXPLICIT_ATTR] = _explicit_names(type(self), args, kwargs)
        except Exception:  # never stand between the user and their arguments
            logger.debug("accelerate_neuron: could not record explicit TrainingArguments fields", exc_info=True)
        original(self, *args, **kwargs)

    return __init__


# ------------------------------------------------------------ __post_init__


def targets_neuron(args: Any) -> bool:
    """Whether these arguments will train on a Neuron core (decided before the device is set up)."""
    if not device.is_available():
        return False
    if getattr(args, "use_cpu", False) or getattr(args, "no_cuda", False):
        return False
    if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in _TRUE:
        return False
    forced = forced_torch_device()  # not Ray Train's CPU fallback for a worker it gave Neuron cores
    return not forced or forced.split(":")[0] == device.DEVICE_TYPE


def wrap_post_init(original: Any) -> Any:
    def __post_init__(self: Any) -> None:
        neuron = targets_neuron(self)
        if neuron:
            precision.check_training_arguments(self)
            _default_compile(self)
        original(self)
        if neuron:
            _default_drop_last(self)

    return __post_init__


def _default_compile(args: Any) -> None:
    wants = args.torch_compile or args.torch_compile_mode is not None
    if not wants or args.torch_compile_backend is not None or getattr(args, "torchdynamo", None) is not None:
        return
    config = train_compile_config()
    args.torch_compile_backend = config["backend"]
    if args.torch_compile_mode is None and config["mode"] is not None:
        args.torch_compile_mode = config["mode"]


def _default_drop_last(args: Any) -> None:
    if not args.torch_compile or not device.is_neuron(args.device):
        return
    explicit = explicit_fields(args)
    if explicit is not None and "dataloader_drop_last" in explicit:
        return
    if explicit is None and args.dataloader_drop_last:
        return
    from .shapes import resolve_policy

    wanted = resolve_policy(None).drop_last
    if wanted and not args.dataloader_drop_last:
        args.dataloader_drop_last = True
        args.__dict__[DROP_LAST_ATTR] = True
        logs.once(
            logger,
            "training.drop_last",
            "accelerate_neuron: dataloader_drop_last=True (was unset): with torch_compile on Neuron a smaller last "
            "training batch is one more compiled graph. Evaluation still sees every sample. To keep the last batch, "
            "pass dataloader_drop_last=False.",
        )


# ------------------------------------------------------------ device (4.x)


def wrap_setup_devices(original: Any) -> Any:
    func = original.func

    def _setup_devices(self: Any) -> Any:
        found = func(self)
        try:
            return _neuron_device(self, found)
        except Exception:
            logger.debug("accelerate_neuron: kept TrainingArguments device %s", found, exc_info=True)
            return found

    _setup_devices.__name__ = func.__name__
    _setup_devices.__qualname__ = func.__qualname__
    _setup_devices.__doc__ = func.__doc__
    replacement = type(original)(_setup_devices)
    replacement.__set_name__(None, original.attrname)
    return replacement


def _neuron_device(args: Any, found: Any) -> Any:
    import torch

    if found.type != "cpu" or not targets_neuron(args):
        return found
    state = getattr(args, "distributed_state", None)
    distributed = str(getattr(state, "distributed_type", "NO")).rsplit(".", 1)[-1]
    if distributed != "NO":
        return found  # a launched run: accelerate's state owns the rank's core
    index = 0
    device.set_current_core(index)
    chosen = torch.device(device.DEVICE_TYPE, index)
    if state is not None and getattr(state, "device", None) is not None and state.device.type != device.DEVICE_TYPE:
        # Accelerate < 1.13 chose the CPU for the same process: the Trainer's
        # Accelerator shares this state, and would move the model back.
        state.device = chosen
    args._n_gpu = 1
    return chosen


def setup_devices_needed(original: Any) -> str | None:
    func = getattr(original, "func", None)
    if func is None:
        return f"_setup_devices is no longer a cached_property ({type(original).__name__})"
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return None
    if "neuron" in source:
        return "upstream TrainingArguments already selects the neuron device"
    return None


# ------------------------------------------------------------ bf16 (4.x)


def wrap_bf16_gate(original: Any) -> Any:
    def is_torch_bf16_gpu_available(*args: Any, **kwargs: Any) -> bool:
        return bool(original(*args, **kwargs)) or device.supports_bf16()

    return is_torch_bf16_gpu_available


def bf16_needed(original: Any) -> str | None:
    if original():
        return "upstream already reports bf16 support on this Neuron device"
    return None
