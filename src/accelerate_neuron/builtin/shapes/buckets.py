"""A bucket set: the few sizes one dimension of a model call is padded up to.

Every new input shape of a compiled graph is a new Neuron compile, so each
dimension that varies from call to call (a prompt's length, a batch's rows, a
KV cache's length, a training batch's length, a serving step's query and KV
tokens) is padded up to the smallest bucket that holds it. A size beyond the
largest bucket keeps its own shape, with one warning per size (never an
error); a bucket beyond what the model can address is capped at it, with one
warning naming both values.
"""

from __future__ import annotations

import itertools
import logging

from ... import logs, settings

logger = logging.getLogger(__name__)

MAX_BUCKET = settings.MAX_BUCKET


class Buckets(tuple[int, ...]):
    """Strictly ascending sizes, each ``<= MAX_BUCKET``; empty: this bucketing is off.

    A tuple, so it compares, prints and serializes as the plain sizes do. ``setting``
    names the setting that chose it (its variable goes into the messages).
    """

    setting: str

    def __new__(cls, values: tuple[int, ...] | list[int] = (), setting: str = "") -> Buckets:
        self = super().__new__(cls, values)
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_BUCKET for v in self) or list(
            self
        ) != sorted(set(self)):
            raise ValueError(f"buckets {tuple(self)!r}: expected strictly ascending ints from 1 to {MAX_BUCKET}")
        self.setting = setting
        return self

    def __getnewargs__(self) -> tuple[tuple[int, ...], str]:  # pickled with its setting (worker processes)
        return tuple(self), self.setting

    @property
    def env(self) -> str:
        return settings.env_name(self.setting) if self.setting else "the bucket setting"

    def at_least(self, size: int) -> int | None:
        """The smallest bucket holding ``size``; None when none does, or bucketing is off."""
        return next((b for b in self if b >= size), None)

    def pad_to(self, size: int, caller: str, what: str) -> int:
        """The size ``size`` is padded to: its bucket, or ``size`` itself when bucketing is off or beyond the
        largest (then :func:`warn_beyond_largest`, once per size)."""
        if not self:
            return size
        bucket = self.at_least(size)
        if bucket is None:
            self.warn_beyond_largest(caller, what, size)
            return size
        return bucket

    def warn_beyond_largest(self, caller: str, what: str, size: int) -> None:
        """The one message for a size no bucket holds: it runs at its own shape, and how to add a bucket."""
        logs.once(
            logger,
            ("shapes.beyond_largest", self.setting, what, size),
            "accelerate_neuron: %s got a %s of %d, more than the largest bucket (%d); it runs at its own shape and "
            "compiles its own graph. Add a larger bucket with %s (now %s).",
            caller,
            what,
            size,
            self[-1],
            self.env,
            ",".join(map(str, self)),
        )

    def reaching(self, size: int | None) -> Buckets:
        """The buckets a size of at most ``size`` can be padded to: up to the one holding ``size`` (all of them when
        ``size`` is None, unbounded, or beyond the largest)."""
        top = None if size is None else self.at_least(size)
        return self if top is None else Buckets(tuple(b for b in self if b <= top), self.setting)

    def capped(self, limit: int | None, limit_name: str = "max_position_embeddings", warn: bool = True) -> Buckets:
        """These buckets up to ``limit`` (what the model can address): larger ones give way to ``limit`` itself.

        ``warn``: say so once, naming the bucket and the limit (a user's bucket a model cannot hold).
        """
        if not limit or not self or self[-1] <= limit:
            return self
        kept = [b for b in self if b < limit]
        if warn:
            logs.once(
                logger,
                ("shapes.capped", self.setting, tuple(self), limit),
                "accelerate_neuron: %s has a bucket of %d, beyond this model's %s (%d): sizes up to %d are padded to "
                "%d instead (larger buckets are dropped for this model).",
                self.env,
                self[-1],
                limit_name,
                limit,
                limit,
                limit,
            )
        return Buckets((*kept, limit), self.setting)

    def ending_at(self, limit: int) -> Buckets:
        """The buckets below ``limit``, then ``limit`` itself as the last (a step's token budget, a cache's capacity:
        always a bucket, whatever the list)."""
        return Buckets((*(b for b in self if b < limit), limit), self.setting)

    def halved(self) -> Buckets:
        """These buckets and the point halfway along each step that at least doubles (``a + a // 2``): on powers
        of two, two buckets an octave, ``(16, 32, 64) -> (16, 24, 32, 48, 64)``; ``(1, 2, 4) -> (1, 2, 3, 4)``.

        A lognormal's lengths land anywhere in their bucket: one bucket an octave pads them about 1.5x, two about
        1.3x (benchmarks/RESULTS.md, "Padding"), at about 1.4 to 2 times the graphs (``settings.POW2_HALF``)."""
        values = []
        for low, high in itertools.pairwise(self):
            values.append(low)
            middle = low + low // 2
            if high >= 2 * low and low < middle < high:
                values.append(middle)
        return Buckets((*values, *self[-1:]), self.setting)

    def short(self) -> str:
        """For a log line: ``1, 2, 4, ... 256`` (``off`` when empty)."""
        if not self:
            return "off"
        if len(self) <= 5:
            return ", ".join(map(str, self))
        return f"{self[0]}, {self[1]}, {self[2]}, ... {self[-1]}"


def pow2(low: int, high: int, setting: str = "") -> Buckets:
    """Powers of two from ``low`` while below ``high``, then ``high`` itself (a power of two or not):
    ``pow2(32, 100) == (32, 64, 100)``; ``pow2(32, 16) == (16,)``."""
    values, value = [], low
    while value < high:
        values.append(value)
        value *= 2
    return Buckets((*values, high), setting)


def round_up_pow2(size: int, minimum: int) -> int:
    """The smallest power of two holding ``size``, at least ``minimum`` (an unbounded power-of-two bucket list)."""
    return max(minimum, 1 << (size - 1).bit_length())


def round_up_pow2_half(size: int, minimum: int) -> int:
    """The smallest bucket of ``pow2(minimum, ...).halved()``, unbounded, holding ``size`` (``minimum`` a power of
    two): the power of two :func:`round_up_pow2` gives, or three quarters of it when that holds ``size`` and lies
    above ``minimum``."""
    power = round_up_pow2(size, minimum)
    middle = power // 4 * 3
    return middle if power >= 4 and middle >= size and middle > minimum else power
