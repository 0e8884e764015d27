"""Where ``generate()``'s tensors live when the model is on Neuron.

The rule: the tensors the loop grows every step (ids, attention mask,
position ids, ...) stay on the host, so every compiled decode graph sees the
same input shapes; only what ``forward`` consumes moves to the model's device,
right before each forward; the result goes back to the device the caller's
inputs were on. Where each growing tensor lives is the
``neuron_generation_tensor_device`` hook's answer. The functions here do the
moving; :class:`~.call.GenerateCall` decides when.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import device as neuron_device
from ...plugins import call_hook
from ..model_devices import model_device, move, split_across_devices

__all__ = ["bring_home", "model_device", "move", "select_greedy", "send_back", "split_across_devices", "tensor_device"]

#: Keyword arguments of ``generate`` that the loop grows, or that decide the
#: device of what it grows (``inputs_tensor.device`` in upstream's code).
GROWING = (
    "inputs",
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "cache_position",
    "mm_token_type_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
    "decoder_inputs_embeds",
)
#: Names whose device is "the caller's device" for the returned result.
PRIMARY = ("inputs", "input_ids", "inputs_embeds", "decoder_input_ids")
#: Output fields left where the model keeps them.
KEEP_IN_PLACE = frozenset({"past_key_values", "cache", "cache_params"})


def tensor_device(name: str, dev: torch.device) -> torch.device | None:
    """Where ``generate()`` keeps tensor ``name`` (the ``neuron_generation_tensor_device`` hook answers)."""
    answer = call_hook("neuron_generation_tensor_device", name=name, model_device=dev)
    if answer is None:
        return None
    try:
        return torch.device(answer)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(
            f"neuron_generation_tensor_device returned {answer!r} for {name!r}: expected a torch.device, "
            "a device string such as 'cpu' or 'neuron:0', or None"
        ) from exc


def bring_home(
    model: Any, dev: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], torch.device | None]:
    """Move the growing tensors the caller put on Neuron to where the hook says.

    Returns the new ``(args, kwargs)`` and the caller's device if the result
    must be sent back there (``None``: leave the result where upstream puts it).
    """
    main_input = getattr(model, "main_input_name", "input_ids")
    names = dict.fromkeys((*GROWING, main_input))
    kwargs = dict(kwargs)
    args = list(args)
    caller: torch.device | None = None
    for name in names:
        if name == "inputs" and args:
            value, where = args[0], "args"
        elif name in kwargs:
            value, where = kwargs[name], "kwargs"
        else:
            continue
        if not isinstance(value, torch.Tensor) or value.device.type != neuron_device.DEVICE_TYPE:
            continue
        hook_name = main_input if name == "inputs" else name
        target = tensor_device(hook_name, dev)
        if target is None or target == value.device:
            continue
        if caller is None and (name in PRIMARY or name == main_input):
            caller = value.device
        moved = value.to(target)
        if where == "args":
            args[0] = moved
        else:
            kwargs[name] = moved
    return tuple(args), kwargs, caller


def send_back(result: Any, caller: torch.device | None) -> Any:
    """The generate result on the caller's device; caches stay on the model's device."""
    if caller is None:
        return result
    if isinstance(result, torch.Tensor):
        return move(result, caller)
    if isinstance(result, dict):  # GenerateOutput classes are ModelOutput (an OrderedDict)
        for key in list(result.keys()):
            if key in KEEP_IN_PLACE:
                continue
            value = result[key]
            moved = move(value, caller)
            if moved is not value:
                result[key] = moved  # ModelOutput.__setitem__ keeps the attribute in step
    return result


def select_greedy(outputs: Any, rows: int | None = None) -> Any:
    """Replace ``outputs.logits`` by a host one-hot row of the device-side argmax.

    Upstream copies the last logits row ``[batch, vocab]`` to the host every
    step to take its argmax; the argmax of this one-hot row is the same token,
    and only ``batch`` ids cross the device boundary. ``rows``: keep only the
    first rows (the caller's, when dummy rows pad the batch); the argmax runs on
    the whole padded batch, so its shape is the bucket's.
    """
    logits = getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        return outputs
    ids = logits[:, -1].argmax(dim=-1).to("cpu")
    if rows is not None:
        ids = ids[:rows]
    onehot = torch.zeros((ids.shape[0], 1, logits.shape[-1]), dtype=torch.float32)
    onehot.scatter_(-1, ids.view(-1, 1, 1), 1.0)
    outputs.logits = onehot
    return outputs
