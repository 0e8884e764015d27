"""``generate()``'s next token picked on the device when it samples (or decodes greedily with processors).

Upstream's loop copies the last logits row (``[rows, vocab]`` float32: 128,008 bytes a row at a
32,000-token vocabulary) to the host every step, runs the logits processors there and draws with
``torch.multinomial``. For a call on Neuron whose processors all have a device version
(:mod:`..sampling.program`), :func:`plan` returns a :class:`DeviceSampling` instead, and ``_sample``
(see :mod:`.wrappers`) runs with:

- no logits processor and ``do_sample=False`` on its own copy of the generation config: upstream's
  loop then takes the argmax of the row it gets;
- after every forward (the instance's ``_update_model_kwargs_for_generation``, which upstream calls
  on every forward's output before reading the logits), :meth:`DeviceSampling.choose` runs the
  compiled sampling step on the device and replaces the logits with a host one-hot row of the drawn
  token: one int64 id per row crosses to the host.

The caller gets the tokens of upstream's distribution, drawn from the device's random number
generator: reproducible under ``torch.manual_seed``, but not the tokens the CPU would draw
(docs/generation.md, "Sampling on the device"). A call whose processors cannot all run on the device,
or that asks for ``output_scores`` / ``output_logits`` (full rows, by definition), keeps the host path;
an unsupported processor is named once in the log.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ... import device as neuron_device
from ... import logs, settings
from .. import overrides
from ..sampling import ops as sampling_ops
from ..sampling import program as sampling_program
from ..sampling import step as sampling_step
from . import devices

logger = logging.getLogger(__name__)

DEVICE_SAMPLING_ENV = settings.env_name("device_sampling")
TOPK_ENV = settings.env_name("sampling_topk")
_UPDATE_ATTR = "_update_model_kwargs_for_generation"
_CHOOSER_FLAG = "_accelerate_neuron_chooser"


class DeviceSampling:
    """The sampling of one ``_sample`` call, on the device: its program, tensors and carried state."""

    def __init__(
        self, processors: list[Any], input_ids: torch.Tensor, greedy: bool, max_length: int, host_config: Any
    ) -> None:
        self.processors = processors
        self.input_ids = input_ids  # the caller's ids as _sample starts (host)
        self.greedy = greedy
        self.max_length = max_length
        self.host_config = host_config  # what upstream's loop runs with: do_sample=False
        self.rows = int(input_ids.shape[0])
        self.program: sampling_program.Program | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._state: dict[str, torch.Tensor] = {}
        self.steps = 0

    def _start(self, logits: torch.Tensor) -> None:
        """Translate the processors for the logits' vocabulary, and send the tensors over (once per call)."""
        vocab = int(logits.shape[-1])
        ctx = sampling_program.Context(vocab, self.input_ids)
        translation = sampling_program.translate(
            self.processors,
            ctx,
            greedy=self.greedy,
            candidates=settings.get("sampling_topk"),
            max_length=self.max_length,
        )
        self.program = translation.program
        rows = int(logits.shape[0])  # the caller's rows, plus a batch bucket's dummy rows
        self._params = {k: _fill_rows(v, self.rows, rows).to(logits.device) for k, v in translation.params.items()}
        self._state = {k: _fill_rows(v, self.rows, rows).to(logits.device) for k, v in translation.state.items()}
        if self.program.path == "vocabulary" and self.program.warpers & {"top_k", "top_p"}:
            logs.once(
                logger,
                "generation.sampling_vocabulary",
                "accelerate_neuron: generate() samples on the device over the whole vocabulary for this call "
                "(top_k unset, 0 or above %d, with top_p/top_k): exact, cut-offs found by bisection (%d passes "
                "over the vocabulary per filter) instead of the %d-candidate fast path; set top_k <= %d to take "
                "it, or raise %s.",
                settings.get("sampling_topk"),
                sampling_ops.STEPS,
                settings.get("sampling_topk"),
                settings.get("sampling_topk"),
                TOPK_ENV,
                level=logging.INFO,
            )

    def choose(self, outputs: Any) -> Any:
        """Draw this step's tokens on the device; ``outputs.logits`` becomes a host one-hot row of them."""
        logits = getattr(outputs, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
            # Upstream's loop now takes an argmax: going on would silently decode greedily.
            raise RuntimeError(
                "accelerate_neuron: sampling on the device expected the forward's logits as [rows, length, vocab], "
                f"got {type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}; set {DEVICE_SAMPLING_ENV}=0 "
                "for upstream's host path and report the model"
            )
        last = logits[:, -1] if logits.dim() == 3 else logits
        if self.program is None:
            self._start(last)
        assert self.program is not None
        if last.device.type == neuron_device.DEVICE_TYPE:
            step = sampling_step.compiled(self.program)
        else:  # logits left on the host (e.g. an offloaded head): the same arithmetic, eagerly, there
            step = functools.partial(sampling_step.run, self.program)
        ids, self._state = step(last, self._params, self._state)
        self.steps += 1
        ids = ids.to("cpu")[: self.rows]
        onehot = torch.zeros((self.rows, 1, last.shape[-1]), dtype=torch.float32)
        onehot.scatter_(-1, ids.view(-1, 1, 1), 1.0)
        outputs.logits = onehot
        return outputs


def _fill_rows(value: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    """``value`` with its per-row tensors extended from ``rows`` to ``total`` (dummy rows copy row 0)."""
    if value.dim() == 0 or value.shape[0] != rows or total == rows:
        return value
    extra = value[:1].expand(total - rows, *value.shape[1:])
    return torch.cat([value, extra.clone()], dim=0)


def plan(call: Any, input_ids: Any, logits_processor: Any, config: Any) -> DeviceSampling | None:
    """A :class:`DeviceSampling` when this ``_sample`` call can pick its tokens on the device, else None."""
    reason = _host_reason(call, input_ids, logits_processor, config)
    if reason is not None:
        logger.debug("accelerate_neuron: generate() picks the next token on the host: %s", reason)
        return None
    processors = list(logits_processor)
    refused = sampling_program.unsupported(processors)
    if refused is not None:
        logs.once(
            logger,
            ("generation.sampling_host", refused),
            "accelerate_neuron: generate() on Neuron picks the next token on the host for calls with %s, which "
            "has no device version: the whole logits row crosses to the host every step. The device covers "
            "temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size, sequence_bias, "
            "bad_words_ids, suppress_tokens, begin_suppress_tokens, min_length, min_new_tokens, "
            "forced_bos/eos_token_id and remove_invalid_values.",
            refused,
        )
        return None
    host_config = copy.copy(config)
    host_config.do_sample = False
    max_length = getattr(config, "max_length", None) or int(input_ids.shape[1]) + 1
    return DeviceSampling(processors, input_ids, not config.do_sample, int(max_length), host_config)


def _host_reason(call: Any, input_ids: Any, logits_processor: Any, config: Any) -> str | None:
    if not settings.get("device_sampling"):
        return f"{DEVICE_SAMPLING_ENV}=0"
    if config is None or logits_processor is None:
        return "no generation config or logits processor list"
    if not getattr(config, "do_sample", False) and len(logits_processor) == 0:
        return "greedy without processors (the argmax is picked on the device by the greedy path)"
    if getattr(config, "output_scores", False) or getattr(config, "output_logits", False):
        return "output_scores/output_logits asked for (whole rows)"
    if getattr(config, "is_assistant", False):
        return "an assistant model's call"
    if not isinstance(input_ids, torch.Tensor) or input_ids.device.type == neuron_device.DEVICE_TYPE:
        return "token ids kept on the device (assisted decoding)"
    target = devices.tensor_device("logits", call.device)
    if target is None or target.type != neuron_device.DEVICE_TYPE:
        return "the neuron_generation_tensor_device hook keeps the logits on the host"
    return None


@contextlib.contextmanager
def choosing_on(model: Any, current: Any) -> Iterator[None]:
    """For one ``_sample`` call: every forward's logits pass through the current call's device sampling.

    Wraps the instance's ``_update_model_kwargs_for_generation`` (upstream calls it with every forward's
    output, before reading the logits; models that override it are covered too) and removes the wrapper
    afterwards. ``current(model)`` gives the ``GenerateCall`` of the caller's context.
    """

    def build(inner: Any) -> Any:
        @functools.wraps(inner)
        def chooser(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            call = current(model)
            sampling = getattr(call, "sampling", None) if call is not None else None
            if sampling is not None:
                sampling.choose(outputs)
            return inner(outputs, *args, **kwargs)

        return chooser

    with overrides.overridden(model, _UPDATE_ATTR, _CHOOSER_FLAG, build):
        yield
