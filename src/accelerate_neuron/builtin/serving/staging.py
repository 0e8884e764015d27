"""Continuous batching's per-step inputs built on the host, sent to Neuron once per step at the bucket's shape.

Upstream keeps its static input tensors (ids, positions, cumulative lengths,
read/write indices, the attention mask) on the model's device and fills them
request by request: ``tensor[:n] = ...``, a mask block per request, a reset of
the part used last step. Each is a device op whose shape is a request's
length, so on Neuron every new batch composition compiles new eager ops (the
issue measured 511, then 322 more for the next 16 requests). Here the same
tensors live on the host, where that bookkeeping costs no compile, and each
step copies the slices the forward reads to the device: one transfer per
input, at the step's padded (bucket) shape. Only the compiled step writes its
sampled tokens on the device, into a static buffer that comes back whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ... import device as neuron_device
from ..model_devices import move

_NOT_MOVED = ("cache",)  # the paged cache object lives on the device by construction


def host_staged(base: type) -> type:
    """A subclass of upstream's ``ContinuousBatchingIOs`` that stages on the host for a Neuron ``device``."""
    signature = inspect.signature(base.__init__)

    class HostStagedIOs(base):
        """Upstream's IOs on the host; inputs cross to Neuron per step, sampled tokens come back per step."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            self.neuron_device = torch.device(bound.arguments["device"])
            bound.arguments["device"] = torch.device("cpu")
            super().__init__(*bound.args[1:], **bound.kwargs)
            # The compiled step writes its tokens here (a static buffer: one shape for every step).
            self.device_output_ids = torch.zeros_like(self.output_ids, device=self.neuron_device)

        def get_model_kwargs(self, use_padding: bool = False) -> Any:
            kwargs = super().get_model_kwargs(use_padding=use_padding)
            if use_padding and not self.use_block_table:
                # Only flash kernels read max_length_k; for SDPA / eager it is an int Dynamo would guard on, and
                # its unpadded value (the longest request's) would compile a graph per value.
                kv_size = self.max_kv_read + self.num_q_tokens
                kwargs["max_length_k"] = dict.fromkeys(kwargs["max_length_k"], kv_size)
            return {k: v if k in _NOT_MOVED else move(v, self.neuron_device) for k, v in kwargs.items()}

        def get_cb_kwargs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.carry_over_ids, self.device_output_ids, self.device_output_ids

        def prepare_batch_update(self) -> Any:
            self.output_ids.copy_(self.device_output_ids)  # one transfer of the whole static buffer
            return super().prepare_batch_update()

    HostStagedIOs.__qualname__ = HostStagedIOs.__name__ = f"HostStaged{base.__name__}"
    return HostStagedIOs


def wrap_io_class(original: type) -> Callable[..., Any]:
    """``continuous_api.ContinuousBatchingIOs``: the host-staged IOs for a model on Neuron, upstream's otherwise."""
    staged = host_staged(original)
    signature = inspect.signature(original)

    def continuous_batching_ios(*args: Any, **kwargs: Any) -> Any:
        device = signature.bind(*args, **kwargs).arguments.get("device")
        chosen = staged if neuron_device.is_neuron(device) else original
        return chosen(*args, **kwargs)

    continuous_batching_ios.host_staged = staged
    return continuous_batching_ios
