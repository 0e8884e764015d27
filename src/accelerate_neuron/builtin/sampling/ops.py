"""The device math of a sampling step: the warpers (temperature, top-k, top-p, min-p) and the draw.

Traced into a compiled graph, so everything here is tensor arithmetic with static shapes: per-row
parameters are tensors (``[rows]``), never Python numbers, and nothing sorts the whole vocabulary (a
sort of 32k-128k entries per row per step is what the anchors avoid on Neuron).

``top_p`` travels as ``top_p_floor = 1 - top_p``, computed where upstream computes it (the host, in
double precision, for ``generate()``; the device, in float32, for continuous batching), so the cut-off
compares the same float32 numbers.

Two ways to apply the warpers, both giving upstream's distribution (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper`` applied in that order):

- :func:`on_candidates`: the ``K`` best scores of each row (``torch.topk``, sorted), the warpers on
  those only, the draw among them. Exact when every row keeps at most ``K`` tokens after top-k
  (``1 <= top_k <= K``, or a vocabulary of at most ``K``): the tokens outside the candidates are then
  filtered out by top-k anyway. ``K`` is ``ACCELERATE_NEURON_SAMPLING_TOPK`` (256, as the anchors).
- :func:`on_vocabulary`: for rows asking for more (no top-k, or above ``K``) with top-p: the cut-offs
  are found by bisection on the score (:func:`keep_below`): ~50 passes over the vocabulary per
  filter, no sort, exact to float tolerance (two scores closer than ``SPAN / 2**STEPS`` at the cut are
  kept or dropped together).

Ties: upstream's top-k keeps every token tied with the k-th score; so do both ways here, except that
:func:`on_candidates` cannot see ties beyond its ``K`` candidates. Upstream's top-p drops tied tokens
at the nucleus' edge in its sort's order; here tied tokens are kept or dropped together.
"""

from __future__ import annotations

import torch

#: A score this far below its row's maximum has probability exactly 0 in float32 (exp underflows), so a
#: cut-off below it changes nothing.
SPAN = 110.0
#: Bisection steps over ``[max - SPAN, max]``: cut-offs to ``SPAN / 2**STEPS`` (4e-13), finer than the
#: spacing of float32 scores away from zero.
STEPS = 48

NEG_INF = float("-inf")


def keep_below(scores: torch.Tensor, weight: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The tokens whose ``weight`` strictly above them (by score) totals less than ``limit``, per row.

    Top-k is ``weight=1, limit=k`` (fewer than k tokens score higher); top-p is ``weight=probabilities,
    limit=top_p`` (less than top_p of the mass scores higher): upstream's two rules without a sort.
    ``scores`` ``[rows, vocab]`` (filtered tokens ``-inf``), ``limit`` ``[rows]``. The row's best token
    is always kept, as upstream keeps ``min_tokens_to_keep=1``.
    """
    best = scores.amax(dim=-1, keepdim=True)
    hi = best
    lo = best - SPAN
    limit = limit.unsqueeze(-1)
    for _ in range(STEPS):
        mid = (lo + hi) * 0.5
        above = torch.where(scores > mid, weight, 0.0).sum(dim=-1, keepdim=True)
        up = above >= limit
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    return (scores > lo) | (scores >= best)


def _top_p_sorted(values: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Top-p on scores sorted in descending order: upstream's arithmetic (an ascending cumulative sum)."""
    ascending = values.flip(-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= floor.unsqueeze(-1)
    last = torch.arange(values.shape[-1], device=values.device) == values.shape[-1] - 1
    remove = remove & ~last  # min_tokens_to_keep=1: the best token stays
    return values.masked_fill(remove.flip(-1), NEG_INF)


def _min_p(values: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = values.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    # The best token is never below min_p times itself: upstream's min_tokens_to_keep=1 holds by itself.
    return values.masked_fill(probs < min_p.unsqueeze(-1) * top, NEG_INF)


def warp_candidates(
    scores: torch.Tensor,
    params: dict[str, torch.Tensor],
    warpers: frozenset[str],
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(warped scores ``[rows, K]``, filtered ones ``-inf``; their token ids ``[rows, K]``) on the K best scores."""
    values, ids = torch.topk(scores, candidates, dim=-1)
    if "temperature" in warpers:
        values = values / params["temperature"].unsqueeze(-1)
    if "top_k" in warpers:
        top_k = params["top_k"]
        kth = values.gather(-1, (top_k.clamp(1, candidates) - 1).unsqueeze(-1))
        keep = (values >= kth) | (top_k <= 0).unsqueeze(-1)  # top_k <= 0: this row has no top-k
        values = values.masked_fill(~keep, NEG_INF)
    if "top_p" in warpers:
        values = _top_p_sorted(values, params["top_p_floor"])
    if "min_p" in warpers:
        values = _min_p(values, params["min_p"])
    return values, ids


def on_candidates(
    scores: torch.Tensor,
    params: dict[str, torch.Tensor],
    warpers: frozenset[str],
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities ``[rows, K]``, their token ids ``[rows, K]``) after the warpers, on the K best scores."""
    values, ids = warp_candidates(scores, params, warpers, candidates)
    return values.softmax(dim=-1), ids


def warp_vocabulary(scores: torch.Tensor, params: dict[str, torch.Tensor], warpers: frozenset[str]) -> torch.Tensor:
    """The warped scores ``[rows, vocab]`` (filtered ones ``-inf``), on the whole vocabulary (cut-offs by bisection)."""
    if "temperature" in warpers:
        scores = scores / params["temperature"].unsqueeze(-1)
    if "top_k" in warpers:
        top_k = params["top_k"]
        keep = keep_below(scores, torch.ones_like(scores), top_k.to(scores.dtype)) | (top_k <= 0).unsqueeze(-1)
        scores = scores.masked_fill(~keep, NEG_INF)
    if "top_p" in warpers:
        # Upstream drops a token when the mass at or below it is at most 1 - top_p: when the mass strictly
        # above it is at least (total - (1 - top_p)).
        floor = params["top_p_floor"]
        probs = scores.softmax(dim=-1)
        limit = probs.sum(dim=-1) - floor
        keep = keep_below(scores, probs, limit) | (floor <= 0).unsqueeze(-1)
        scores = scores.masked_fill(~keep, NEG_INF)
    if "min_p" in warpers:
        scores = _min_p(scores, params["min_p"])
    return scores


def on_vocabulary(scores: torch.Tensor, params: dict[str, torch.Tensor], warpers: frozenset[str]) -> torch.Tensor:
    """Probabilities ``[rows, vocab]`` after the warpers, on the whole vocabulary."""
    return warp_vocabulary(scores, params, warpers).softmax(dim=-1)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row, with probability ``probs`` (rows need not be normalised), from the device's RNG.

    The exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks ``i`` with probability
    ``p_i / sum(p)``, the distribution ``torch.multinomial`` draws from, with one uniform draw per entry
    and no cumulative sum or search (``torch.rand`` is the random op every backend has). A token of
    probability 0 is never picked.
    """
    uniform = torch.rand(probs.shape, device=probs.device, dtype=torch.float32)
    exponential = -torch.log(uniform)  # a uniform of exactly 0 gives +inf: that entry only loses its race
    return (probs / exponential).argmax(dim=-1)
