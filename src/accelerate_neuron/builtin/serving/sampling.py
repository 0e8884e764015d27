"""Continuous batching's sampling on Neuron: per-request warpers without a sort, a draw without multinomial.

Upstream already samples inside the compiled step (``ModelRunner._forward_process_and_sample``) with
per-request temperature, top-k and top-p as tensors (``logits_processor_args``), so no parameter value
compiles a graph and only the output ids come back. What it runs there does not suit Neuron: its
per-request top-k and top-p each sort the whole vocabulary of every row (``torch.sort``, 32k-128k
entries, twice a step), and the draw is ``torch.multinomial``. For a step on Neuron these patches run,
inside the same compiled step:

- ``ContinuousBatchingLogitsProcessorList.__call__``: the processors before the warpers as upstream
  runs them, then the warpers (temperature, top-k, top-p, min-p; per-request or not) from
  :mod:`..sampling.ops`: on each row's ``K`` best scores when top-k is on (``K``:
  ``ACCELERATE_NEURON_SAMPLING_TOPK``, 256; a request's ``top_k`` above ``K`` acts as ``K``, the
  anchors' bound, said once when the runner starts), on the whole vocabulary by bisection otherwise
  (exact);
- ``ModelRunner._sample``: the draw from the device's random numbers (the exponential race of
  :func:`..sampling.ops.draw`), log-probabilities as upstream computes them.

``ACCELERATE_NEURON_DEVICE_SAMPLING=0`` leaves upstream's code in place.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ... import device as neuron_device
from ... import logs, settings
from ..sampling import ops
from . import plan as serving_plan

logger = logging.getLogger(__name__)

_KINDS = {
    "ContinuousBatchingTemperatureLogitsWarper": ("temperature", True),
    "ContinuousBatchingTopKLogitsWarper": ("top_k", True),
    "ContinuousBatchingTopPLogitsWarper": ("top_p", True),
    "TemperatureLogitsWarper": ("temperature", False),
    "TopKLogitsWarper": ("top_k", False),
    "TopPLogitsWarper": ("top_p", False),
    "MinPLogitsWarper": ("min_p", False),
}
_ORDER = ("temperature", "top_k", "top_p", "min_p")


def _on_neuron(scores: torch.Tensor) -> bool:
    return scores.device.type == neuron_device.DEVICE_TYPE and settings.get("device_sampling")


def warper_tail(processors: list[Any]) -> int | None:
    """Where the warpers this module runs start in ``processors`` (all of them to the end), or None.

    None when a warper it does not know follows, when they are out of upstream's order, or when one
    keeps more than one token or fills with something other than ``-inf``.
    """
    start = len(processors)
    while start > 0 and type(processors[start - 1]).__name__ in _KINDS:
        start -= 1
    kinds = [_KINDS[type(p).__name__][0] for p in processors[start:]]
    if not kinds or kinds != sorted(set(kinds), key=_ORDER.index):
        return None
    for processor in processors[start:]:
        if getattr(processor, "filter_value", ops.NEG_INF) != ops.NEG_INF:
            return None
        if getattr(processor, "min_tokens_to_keep", 1) != 1:
            return None
    return start


def _per_row(processor: Any, kind: str, arg: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """The warper's value for each row: from its per-request tensor, or its one value."""
    if arg is not None:
        raw = arg[:rows]
        if kind == "top_k":
            return raw.to(torch.long)
        value = raw.view(dtype=torch.float32)
        return 1 - value if kind == "top_p" else value  # upstream's float32 (1 - top_p), on the device
    if kind == "temperature":
        return torch.full((rows,), float(processor.temperature), device=device)
    if kind == "top_k":
        return torch.full((rows,), int(processor.top_k), dtype=torch.long, device=device)
    if kind == "top_p":
        return torch.full((rows,), 1 - float(processor.top_p), device=device)
    return torch.full((rows,), float(processor.min_p), device=device)


def warp(processors: list[Any], start: int, scores: torch.Tensor, args: list[torch.Tensor | None]) -> torch.Tensor:
    """The scores ``[rows, vocab]`` after the warpers ``processors[start:]``, filtered ones ``-inf``."""
    rows, vocab = scores.shape
    params: dict[str, torch.Tensor] = {}
    kinds = []
    for processor, arg in zip(processors[start:], args, strict=True):
        kind = _KINDS[type(processor).__name__][0]
        kinds.append(kind)
        params["top_p_floor" if kind == "top_p" else kind] = _per_row(processor, kind, arg, rows, scores.device)
    warpers = frozenset(kinds)
    candidates = min(settings.get("sampling_topk"), vocab)
    if "top_k" in warpers or vocab <= candidates:
        values, ids = ops.warp_candidates(scores, params, warpers, candidates)
        return torch.full_like(scores, ops.NEG_INF).scatter(-1, ids, values)
    return ops.warp_vocabulary(scores, params, warpers)


def wrap_processor_list_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ContinuousBatchingLogitsProcessorList.__call__``: the warpers without a sort on Neuron."""

    @functools.wraps(original)
    def call(self: Any, input_ids: torch.Tensor, scores: torch.Tensor, logits_processor_args: torch.Tensor) -> Any:
        processors = list(self.logits_processor)
        start = warper_tail(processors) if _on_neuron(scores) else None
        if start is None:
            return original(self, input_ids, scores, logits_processor_args)
        per_request = [_KINDS.get(type(p).__name__, ("", False))[1] for p in processors]
        row = 0
        for processor in processors[:start]:  # upstream's own processors before the warpers, as upstream runs them
            if hasattr(processor, "prepare_tensor_args"):  # upstream's test: a ContinuousBatchingLogitsProcessor
                scores = processor(scores, logits_processor_args[row])
                row += 1
            else:
                scores = processor(input_ids, scores)
        args: list[torch.Tensor | None] = []
        for index in range(start, len(processors)):
            if per_request[index]:
                args.append(logits_processor_args[row])
                row += 1
            else:
                args.append(None)
        return warp(processors, start, scores, args)

    return call


def wrap_runner_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ModelRunner._sample``: on Neuron, the draw from the device's random numbers instead of multinomial."""

    @functools.wraps(original)
    def _sample(self: Any, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        if not (self.do_sample and _on_neuron(scores)):
            return original(self, scores, output_ids)
        probs = torch.nn.functional.softmax(scores[0], dim=-1)  # [num_logits, vocab], as upstream
        next_tokens = ops.draw(probs)
        tokens = next_tokens.size(0)
        output_ids[0, :tokens].copy_(next_tokens)
        if self.return_logprobs:
            logprobs = probs.gather(dim=1, index=next_tokens.unsqueeze(-1)).squeeze(-1).log()
            output_ids[1, :tokens].copy_(logprobs.view(dtype=torch.int32))
        return None

    return _sample


def wrap_runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ModelRunner.__init__``: say once how a sampling runner on Neuron samples (its top-k bound)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not getattr(self, "do_sample", False) or serving_plan.of(getattr(self, "cb_config", None)) is None:
            return
        if not settings.get("device_sampling"):
            return
        processors = list(getattr(getattr(self, "logit_processor", None), "logits_processor", []) or [])
        start = warper_tail(processors)
        if start is None:
            return
        kinds = [_KINDS[type(p).__name__][0] for p in processors[start:]]
        bound = settings.get("sampling_topk")
        how = (
            f"each request among its {bound} best tokens (a request's top_k above {bound} acts as {bound}, as on "
            "the anchors)"
            if "top_k" in kinds
            else "over the whole vocabulary (exact; the cut-offs by bisection, no sort)"
        )
        logs.once(
            logger,
            ("serving.sampling", "top_k" in kinds, bound),
            "accelerate_neuron: continuous batching on Neuron samples inside its compiled step (%s) %s, drawing "
            "from the device's random numbers: reproducible under torch.manual_seed, not the CPU's tokens. "
            "%s=%d sets the bound; %s=0 keeps upstream's sort and multinomial.",
            ", ".join(kinds),
            how,
            settings.env_name("sampling_topk"),
            bound,
            settings.env_name("device_sampling"),
            level=logging.INFO,
        )

    return __init__
