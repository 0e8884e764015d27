"""How many positions a speculative forward computes: the widths draft and target forwards are padded to.

Every new input shape of a compiled graph is a new Neuron compile, and speculative decoding feeds its models
sequences of every length: the prompt plus the first candidates, then the last accepted token plus k candidates,
k anywhere from 0 to the draft's limit. So each forward is right-padded to a width from a short list:

- the first forward of a call (the prompt, with the first candidates for the target) to a prompt bucket
  (``prompt_buckets``, the ones plain ``generate()`` uses);
- a verification forward (1 + k tokens) to 1 + a candidate bucket (``candidate_buckets``: 1, 2, 4, ... 64), never
  below the call's candidate limit (``floor``): a call whose limit does not change runs one verification width,
  its own limit when the candidate buckets include it (they do for ``num_assistant_tokens`` with the constant
  schedule and for ``prompt_lookup_num_tokens``);
- a draft's later forwards: 1 token, or the few tokens it catches up on, to 1 + a candidate bucket.

More tokens than the largest candidate bucket run at a prompt bucket; beyond the largest prompt bucket a forward
runs at its own width, with a warning once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import settings
from .. import shapes

CANDIDATE_BUCKETS_ENV = settings.env_name("candidate_buckets")
#: The ``pow2`` candidate buckets: one verification graph per bucket a call reaches.
POW2_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def candidate_buckets(fixed: int | None = None) -> shapes.Buckets:
    """The ``candidate_buckets`` setting's counts, with ``fixed`` (a call's unchanging candidate limit) added."""
    spec = settings.get("candidate_buckets")
    values = tuple(shapes.from_spec(spec, "candidate_buckets", lambda: shapes.Buckets(POW2_CANDIDATES)))
    if values and fixed is not None and 0 < fixed <= shapes.MAX_BUCKET:
        values = tuple(sorted({*values, fixed}))
    return shapes.Buckets(values, "candidate_buckets")


@dataclass(frozen=True)
class Widths:
    """The widths of one model's forwards in one speculative call."""

    prompt: shapes.Buckets  # prompt buckets (empty: off)
    candidates: shapes.Buckets  # candidate-count buckets (empty: off)

    def width(self, tokens: int, first: bool, floor: int = 0) -> int:
        """The width a forward of ``tokens`` real tokens runs at (``first``: the call's first forward of this model;
        ``floor``: the candidate count a verification is sized for at least)."""
        if first:
            return self.prompt.pad_to(tokens, "speculative decoding", "first forward of")
        wanted = max(tokens - 1, floor)
        if wanted == 0:
            return 1
        if not self.candidates:
            return max(tokens, 1 + floor)
        bucket = self.candidates.at_least(wanted)
        if bucket is None:
            return self.prompt.pad_to(max(tokens, 1 + floor), "speculative decoding", "forward of")
        return 1 + bucket


def widths_for(max_position_embeddings: int | None, fixed: int | None = None) -> Widths:
    """The widths in force: the prompt-bucket policy and the candidate buckets (with a call's fixed limit)."""
    policy = shapes.resolve_policy(max_position_embeddings)
    return Widths(policy.prompt_buckets, candidate_buckets(fixed))
