"""Rows of one call grouped by the bucket of their own length: each group padded to its bucket, not the longest row's.

A batch is padded to its longest row; a bucket pads it further. When a few long rows sit among many short ones,
padding every row to the long rows' bucket computes most positions for nothing. Grouping the rows by the bucket
of their own extent (the columns that hold their real tokens) and running each group at its bucket (and the
batch bucket of its row count) computes far fewer, at one compiled graph per (group rows, bucket) shape.
``generate()`` groups its prefill (:mod:`..generation.groups`), inference calls their forward (:mod:`..inference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .buckets import Buckets

#: Rows beyond this many are not split (the plan is quadratic in the rows).
MAX_ROWS = 512


@dataclass(frozen=True)
class Group:
    """Rows of the batch (indices) whose extents fit ``bucket`` columns, run as ``padded_rows`` rows."""

    rows: tuple[int, ...]
    bucket: int
    padded_rows: int


def plan(
    row_extents: Sequence[int], width: int, prompt_buckets: Buckets, batch_buckets: Buckets, rows: int
) -> list[Group] | None:
    """The groups of a batch that would run at ``width`` columns over ``rows`` rows (dummy rows included), or None
    when one call computes no fewer positions.

    The rows, sorted by extent, are cut into consecutive runs; a run computes its batch bucket (of its row count)
    times the length bucket of its longest row, and each run past the first costs one row of its length more (a
    launch). The cheapest cuts come from an exact dynamic program over the sorted rows (O(rows^2), ties to fewer
    groups), so a group's row count lands on a batch bucket where that saves more than dummy rows cost.
    """
    count = len(row_extents)
    if count < 2 or count > MAX_ROWS:
        return None
    order = sorted(range(count), key=lambda r: (row_extents[r], r))
    lengths = [min(prompt_buckets.at_least(row_extents[r]) or width, width) for r in order]
    best = [0] + [0] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        length = lengths[end - 1]
        # Each run past the first is one more launch of the model (its weights read again): it must save at least
        # one row of its length to be worth it.
        candidates = []
        for start in range(end):
            rows_run = batch_buckets.at_least(end - start) or end - start
            candidates.append((best[start] + rows_run * length + (length if start else 0), start))
        best[end], cut[end] = min(candidates, key=lambda item: item[0])
    if best[count] >= rows * width:  # one call (its own dummy rows) is no dearer
        return None
    groups = []
    end = count
    while end > 0:
        start = cut[end]
        members = tuple(sorted(order[start:end]))
        groups.append(Group(members, lengths[end - 1], batch_buckets.at_least(end - start) or end - start))
        end = start
    if len(groups) < 2:
        return None
    return sorted(groups, key=lambda g: (g.bucket, g.rows))


def right_padded_extents(mask: torch.Tensor) -> list[int] | None:
    """Each row's extent when every row's real tokens come first (mask 1s then 0s): its count of real tokens.
    None when a row is padded otherwise (on the left, or with holes): such a batch is not split."""
    host = mask.to("cpu") != 0
    counts = host.sum(dim=1)
    prefix = torch.arange(host.shape[1]).unsqueeze(0) < counts.unsqueeze(1)
    if not torch.equal(host, prefix):
        return None
    return [max(1, int(c)) for c in counts]


def shapes_of(groups: Sequence[Group] | None) -> list[list[int]] | None:
    """The (rows, columns) the groups run at: what decides their graphs."""
    return None if groups is None else [[g.padded_rows, g.bucket] for g in groups]
