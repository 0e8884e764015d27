"""Buckets fitted to the sizes a job sees: the set that computes the fewest positions under a graph budget.

Given a histogram of sizes (a size and how many rows it padded), choosing ``k``
buckets that minimize the positions computed, ``sum(count * bucket(size))``, is
an exact dynamic program over the sorted distinct sizes: every optimal bucket is
one of the recorded sizes (a bucket between two of them only computes more), and
the largest recorded size is always one. With ``W`` the running total of counts,

    best[m][j] = x[j] * W[j] + min over i < j of (best[m-1][i] - x[j] * W[i])

is a minimum over lines of slopes ``-W[i]`` (decreasing) queried at ``x[j]``
(increasing): a monotone convex-hull walk keeps it O(n) per bucket, O(n * k) in
all. Integer arithmetic throughout, and ties go to the earlier candidate, so the
answer is a pure function of the histogram: identical on every rank and run.

A set fitted to few sizes can fit them too closely: every bucket sits on a size
seen, so the sizes just above it that the job sends next pay up to the next
bucket (a two-humped job fitted to three calls padded its next calls 1.78x where
powers of two padded 1.58x). :func:`held_out` checks a fit on sizes it was not fitted to
(two-fold cross-validation on a deterministic split) before it is used.
"""

from __future__ import annotations

from collections.abc import Mapping

from .buckets import MAX_BUCKET, Buckets, round_up_pow2


def cost(histogram: Mapping[int, int], buckets: tuple[int, ...]) -> int:
    """Positions computed for ``histogram`` under ``buckets`` (a size beyond the largest at its own size)."""
    chosen = Buckets(tuple(buckets))
    return sum(count * (chosen.at_least(size) or size) for size, count in histogram.items())


def pow2_budget(histogram: Mapping[int, int]) -> int:
    """The graphs powers of two would spend on ``histogram``: the distinct buckets it reaches."""
    return len({round_up_pow2(size, 1) for size in histogram}) or 1


def with_tail(fitted: tuple[int, ...], tail: tuple[int, ...]) -> tuple[int, ...]:
    """``fitted``, then the buckets of ``tail`` beyond its largest (a size never seen pads as ``tail`` pads it)."""
    return (*fitted, *(b for b in tail if not fitted or b > fitted[-1]))


def fitted(histogram: Mapping[int, int], tail: tuple[int, ...], whole_grid: bool = False) -> tuple[int, ...]:
    """The buckets ``fit`` chooses for ``histogram`` (not empty): as many fitted ones as ``tail`` (the powers of
    two) has buckets the recorded sizes reach, then ``tail``'s beyond the largest size seen.

    ``whole_grid``: every bucket is compiled, reached or not (a server's warm-up), so ``tail``'s bucket above the
    largest size seen counts against the budget too: no more buckets up to it than ``tail`` has there.
    """
    if not tail:
        return fit(histogram, pow2_budget(histogram))
    powers = Buckets(tuple(tail))
    reached = {powers.at_least(size) or size for size in histogram}
    largest = max(histogram)
    above = powers.at_least(largest)
    spare = whole_grid and above is not None and above != largest and len(reached) > 1
    return with_tail(fit(histogram, len(reached) - spare), tail)


def held_out(histogram: Mapping[int, int], tail: tuple[int, ...], whole_grid: bool = False) -> float | None:
    """Positions that sets :func:`fitted` to one half of ``histogram`` compute on the other half, as a share of
    what ``tail`` (the powers of two) computes on it, both halves in turn: below 1 when fitting predicts the job's
    next sizes. None when a half would be empty (one recorded size).

    The split is a fixed hash of (size, occurrence): the same on every rank and run.
    """
    halves: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for size, count in histogram.items():
        for occurrence in range(min(int(count), 1 << 16)):  # enough to split a count; bounded
            mixed = ((int(size) << 20) + occurrence) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
            half = halves[mixed >> 63]
            half[size] = half.get(size, 0) + 1
    if not all(halves):
        return None
    chosen = sum(cost(test, fitted(train, tail, whole_grid)) for train, test in (halves, halves[::-1]))
    powers = sum(cost(half, tail) for half in halves)
    return chosen / powers


def fit(histogram: Mapping[int, int], budget: int) -> tuple[int, ...]:
    """At most ``budget`` buckets minimizing the positions ``histogram`` computes (exact; empty histogram: ``()``).

    ``histogram``: size -> count (sizes from 1 to ``MAX_BUCKET``, counts > 0).
    """
    items = sorted((int(s), int(c)) for s, c in histogram.items() if c > 0)
    if not items:
        return ()
    if any(not 0 < s <= MAX_BUCKET for s, _ in items) or budget < 1:
        raise ValueError(f"cannot fit buckets to sizes {[s for s, _ in items][:5]}... with a budget of {budget}")
    sizes = [s for s, _ in items]
    if len(sizes) <= budget:
        return tuple(sizes)
    totals = [0]
    for _, count in items:
        totals.append(totals[-1] + count)
    n = len(sizes)
    infinite = None
    best: list[int | None] = [0] + [infinite] * n  # best[j]: positions of the first j sizes, m buckets, j-th one last
    choices: list[list[int]] = []
    for _ in range(budget):
        current: list[int | None] = [infinite] * (n + 1)
        chosen = [0] * (n + 1)
        hull: list[int] = []  # candidate i's (a previous bucket ends at size i), lines of decreasing slope
        head = 0
        for j in range(1, n + 1):
            i = j - 1
            if best[i] is not None:  # add line i: y = best[i] - W[i] * x
                while len(hull) - head >= 2 and _useless(hull[-2], hull[-1], i, best, totals):
                    hull.pop()
                hull.append(i)
                head = min(head, len(hull) - 1)
            if len(hull) - head == 0:
                continue
            x = sizes[j - 1]
            while len(hull) - head >= 2 and _value(hull[head + 1], x, best, totals) <= _value(
                hull[head], x, best, totals
            ):
                head += 1
            i = hull[head]
            current[j] = _value(i, x, best, totals) + x * totals[j]
            chosen[j] = i
        choices.append(chosen)
        best = current
    buckets = []
    j = n
    for chosen in reversed(choices):
        if j == 0:
            break
        buckets.append(sizes[j - 1])
        j = chosen[j]
    return tuple(sorted(buckets))


def _value(i: int, x: int, best: list[int | None], totals: list[int]) -> int:
    value = best[i]
    assert value is not None
    return value - totals[i] * x


def _useless(a: int, b: int, c: int, best: list[int | None], totals: list[int]) -> bool:
    """Whether line ``b`` never wins between ``a`` and ``c`` (slopes -W[a] > -W[b] > -W[c]), in exact integers."""
    ya, yb, yc = best[a], best[b], best[c]
    assert ya is not None and yb is not None and yc is not None
    # Intersection of a and c at or before that of a and b: (yc - ya) / (W[c] - W[a]) <= (yb - ya) / (W[b] - W[a]).
    return (yc - ya) * (totals[b] - totals[a]) <= (yb - ya) * (totals[c] - totals[a])
