"""Padding, counted: positions each call family computed on Neuron, and how many of them were real.

A bucketed call computes the positions of its bucket; only those the caller's
own tokens fill are real (a token its attention mask keeps, a row it asked
for). On Trainium compute is the bill, so the ratio is what bucketing costs.
The capabilities add to one counter per call family as their calls run:

- ``generate_prefill``: the first forward of a ``generate()`` call (its prompt,
  an encoder's input): rows x columns computed; real = the caller's tokens its
  attention mask keeps;
- ``generate_decode``: every later forward of ``generate()``: rows computed per
  step; real = the caller's rows;
- ``forward``: inference calls (``model(...)`` without gradients, pipelines,
  sentence-transformers): rows x length computed; real = the tokens the mask keeps;
- ``training``: training batches padded on the host: rows x length; real = the
  tokens the mask keeps (batches collated in dataloader worker processes are
  counted there, not here);
- ``serving``: continuous batching's steps: query tokens computed; real = the
  requests' own tokens.

:func:`padding_stats` reads them (also ``accelerate_neuron.padding_stats()``),
:func:`reset_padding_stats` zeroes them; ``accelerate-neuron simulate`` prints
the ratios. A family whose ratio stays above :data:`WARN_RATIO` over
:data:`WARN_AFTER` calls logs one line naming the setting that would help.
This module is part of the base layer: plain counters, no torch.
"""

from __future__ import annotations

import logging
import threading

from . import logs, settings

logger = logging.getLogger(__name__)

FAMILIES = ("generate_prefill", "generate_decode", "forward", "training", "serving")
#: A family computing more than this many positions per real one is told how to do better ...
WARN_RATIO = 2.0
#: ... once it has run this many calls (a few odd calls are not a job).
WARN_AFTER = 32
#: The setting that would help each family, and how.
_ADVICE = {
    "generate_prefill": ("prompt_buckets", "fit (buckets fitted to the prompt lengths this job sees)"),
    "generate_decode": ("batch_buckets", "fit, or batch sizes your job uses (e.g. 1,3,6)"),
    "forward": ("prompt_buckets", "fit (buckets fitted to the lengths this job sees)"),
    "training": ("train_buckets", "fit (buckets fitted to the batch lengths this job sees)"),
    "serving": ("serving_token_buckets", "fit (buckets fitted to the step sizes this job sees)"),
}

_lock = threading.Lock()
_counts: dict[str, list[int]] = {family: [0, 0, 0] for family in FAMILIES}  # computed, real, calls


def add(family: str, computed: int, real: int) -> None:
    """Count one call of ``family``: ``computed`` positions, ``real`` of them the caller's own."""
    if family not in _counts:
        raise ValueError(f"unknown call family {family!r}; known: {', '.join(FAMILIES)}")
    with _lock:
        counts = _counts[family]
        counts[0] += int(computed)
        counts[1] += int(real)
        counts[2] += 1
        calls, ratio = counts[2], counts[0] / counts[1] if counts[1] else 0.0
    if calls >= WARN_AFTER and ratio > WARN_RATIO:
        setting, how = _ADVICE[family]
        logs.once(
            logger,
            ("padding.high", family),
            "accelerate_neuron: %s on Neuron has computed %.2f positions per real one over %d calls (padding "
            "buckets far from this job's sizes). %s=%s would cut it; accelerate_neuron.padding_stats() shows it.",
            family,
            ratio,
            calls,
            settings.env_name(setting),
            how,
        )


def padding_stats() -> dict[str, dict[str, int]]:
    """Per call family, ``{"computed": positions computed, "real": real positions}`` since the process started
    (or the last :func:`reset_padding_stats`)."""
    with _lock:
        return {family: {"computed": c[0], "real": c[1]} for family, c in _counts.items()}


def reset_padding_stats() -> None:
    """Zero every family's counters."""
    with _lock:
        for counts in _counts.values():
            counts[:] = [0, 0, 0]


def ratio(stats: dict[str, int]) -> float | None:
    """Positions computed per real one (None before any real position)."""
    return stats["computed"] / stats["real"] if stats.get("real") else None
