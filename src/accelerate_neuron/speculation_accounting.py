"""How much speculative decoding paid off in this process: candidates proposed, accepted, target forwards, tokens.

Speculation (assisted generation, prompt lookup) is worth its draft only when the target model runs fewer forwards
than it generates tokens. The generation plugin adds one record per ``generate()`` call it runs speculatively
(:func:`record`); ``accelerate-neuron simulate`` and the benchmarks read the totals (:func:`snapshot`), and
:func:`accelerate_neuron.speculation_stats` hands them to users. Base layer: no torch, no transformers.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

_lock = threading.Lock()


@dataclass
class Acceptance:
    """Totals over speculative ``generate()`` calls."""

    calls: int = 0
    target_forwards: int = 0  # verification forwards of the target model (the prefill's included)
    draft_forwards: int = 0  # forwards of a draft model (none for prompt lookup)
    candidates: int = 0  # candidate tokens proposed to the target
    accepted: int = 0  # of those, the ones the target kept
    tokens: int = 0  # tokens generated (accepted candidates plus one of the target's own per forward)

    def add(self, other: Acceptance) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def accepted_per_forward(self) -> float:
        """Accepted candidates per target forward (0 without speculation; the ideal is the candidate count)."""
        return self.accepted / self.target_forwards if self.target_forwards else 0.0

    @property
    def forwards_per_token(self) -> float:
        """Target forwards per generated token: 1.0 is plain decoding, below 1 speculation pays."""
        return self.target_forwards / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "accepted_per_forward": round(self.accepted_per_forward, 4),
            "forwards_per_token": round(self.forwards_per_token, 4),
        }


_totals = Acceptance()


def record(call: Acceptance) -> None:
    """Add one speculative call's figures to the process totals."""
    one = Acceptance(**asdict(call))
    one.calls = 1
    with _lock:
        _totals.add(one)


def snapshot() -> dict[str, float]:
    """The process totals since start (or the last :func:`reset`), with the two ratios."""
    with _lock:
        return Acceptance(**asdict(_totals)).as_dict()


def reset() -> None:
    global _totals
    with _lock:
        _totals = Acceptance()
